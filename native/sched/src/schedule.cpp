// Scheduler::schedule(): planning one step and building its flat arrays.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "deepinfer/scheduler.hpp"
#include "util.hpp"

namespace deepinfer {

using detail::bad;
using detail::cdiv;
using detail::S;

bool Scheduler::plan(Sequence* s, int32_t budget, StepEntry& e) const {
  const int32_t vcomp = s->num_computed + s->inflight_q;
  const int32_t vlen = s->len() + s->inflight_emit;
  e = StepEntry{};
  e.seq = s;
  e.epoch = s->epoch;
  e.start = vcomp;
  if (budget < 1) return false;
  if (vcomp < vlen - 1) {  // (re)computing the prompt, possibly in chunks
    int32_t rest = vlen - vcomp;
    e.q = std::min(rest, budget);
    if (!cfg_.enable_chunked_prefill && e.q < rest) return false;
    e.prefill = true;
    e.emit = e.q == rest ? 1 : 0;
    return true;
  }
  if (cfg_.engine_type == EngineType::kPrompt) return false;
  // Decode: the last token plus drafts. With a step in flight, it may already be finished (all of
  // that step's drafts accepted): skip it this time rather than reserve past its limits.
  const int32_t vout = vlen - s->num_prompt_tokens;
  if (vout >= s->limits.max_tokens || vlen >= cfg_.max_model_len) return false;
  e.unknown_inputs = s->inflight_emit > 0;
  // Drafts never push the sequence past max_tokens / max_model_len even if all are accepted.
  int32_t k = e.unknown_inputs ? cfg_.num_speculative_tokens : static_cast<int32_t>(s->draft_tokens.size());
  k = std::min({k, s->limits.max_tokens - vout - 1, cfg_.max_model_len - vlen - 1, budget - 1});
  e.num_drafts = std::max(k, 0);
  e.q = 1 + e.num_drafts;
  e.emit = e.q;
  return true;
}

bool Scheduler::ensure_blocks(Sequence* s, int32_t num_tokens) {
  int32_t need = cdiv(num_tokens, cfg_.block_size) - static_cast<int32_t>(s->block_table.size());
  if (need > bm_.num_free()) return false;
  for (int32_t i = 0; i < need; ++i) s->block_table.push_back(bm_.allocate());
  return true;
}

bool Scheduler::admit_waiting(Sequence* s, int32_t budget, StepEntry& e) {
  if (cfg_.engine_type == EngineType::kCompletion) {
    // The prompt's blocks are already held: it goes straight to decoding.
    if (!plan(s, budget, e)) return false;
    return ensure_blocks(s, e.start + e.q);
  }
  const int32_t len = s->len();
  int32_t max_hit_blocks = (len - 1) / cfg_.block_size;  // at least one token must be computed
  hit_chain_.copy_root(s->chain);  // the request's salt
  int32_t free_hits = bm_.match_prefix(s->tokens.data(), max_hit_blocks, hit_blocks_, hit_chain_);
  const int32_t device_hits = static_cast<int32_t>(hit_blocks_.size());
  // Past the device hit, blocks a lower tier holds are loaded, not computed (a device block after a
  // tier block cannot match: its parent's registration is gone).
  const int32_t loads = bm_.match_loadable(s->tokens.data(), max_hit_blocks, hit_chain_);
  int32_t start = (device_hits + loads) * cfg_.block_size;
  int32_t rest = len - start;
  int32_t q = std::min(rest, budget);
  if (!cfg_.enable_chunked_prefill && q < rest) return false;
  int32_t fresh = cdiv(start + q, cfg_.block_size) - device_hits;
  if (fresh > bm_.num_free() - free_hits) return false;
  bm_.claim_cached(hit_blocks_);
  s->block_table = hit_blocks_;
  for (int32_t i = 0; i < fresh; ++i) s->block_table.push_back(bm_.allocate());
  s->chain = hit_chain_;
  if (loads > 0) {
    // Registered now (their entries arrive before this step's forward), so later requests share them.
    bm_.register_full_blocks(s->tokens.data(), device_hits + loads, s->block_table, s->chain);
    for (int32_t i = device_hits; i < device_hits + loads; ++i) {
      pending_loads_.push_back(BlockLoad{s->seq_id, i, s->block_table[i], BlockKey{s->chain.hashes[i], s->chain.checks[i]}});
    }
  }
  s->num_computed = start;
  s->num_cached_tokens = start;
  s->num_loaded_tokens = loads * cfg_.block_size;
  st_.prefix_query_tokens += len;
  st_.prefix_hit_tokens += device_hits * cfg_.block_size;
  st_.tier_hit_tokens += loads * cfg_.block_size;
  e = StepEntry{};
  e.seq = s;
  e.epoch = s->epoch;
  e.start = start;
  e.q = q;
  e.prefill = true;
  e.emit = q == rest ? 1 : 0;
  return true;
}

std::shared_ptr<StepOutput> Scheduler::schedule() {
  if (inflight_.size() >= 2) {
    throw std::runtime_error(
        "schedule: two steps are already unprocessed; call update_from_output for the older one first");
  }
  auto out = std::make_shared<StepOutput>();
  out->step_id = next_step_id_++;
  out->entries.reserve(running_.size() + 8);
  int32_t budget = cfg_.max_num_batched_tokens;
  bool preempted = false;
  std::vector<const int32_t*> drafts;
  drafts.reserve(running_.size() + 8);

  // 1. Running sequences, in (priority, arrival) order: decodes, draft verification, prompt chunks.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence* s = running_[i];
    StepEntry e;
    if (!plan(s, budget, e)) {
      ++i;
      continue;
    }
    // Out of blocks: preempt from the back (lowest priority, latest arrival) until it fits; when
    // the back is this very sequence, it is the one preempted.
    bool self_preempted = false;
    while (!ensure_blocks(s, e.start + e.q)) {
      Sequence* victim = running_.back();
      preempt(victim, *out);
      preempted = true;
      if (victim == s) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) continue;  // running_[i] is now the next sequence (or the end)
    budget -= e.q;
    out->entries.push_back(e);
    drafts.push_back(e.unknown_inputs ? nullptr : s->draft_tokens.data());
    ++i;
  }

  // 2. Waiting sequences, in (priority, arrival) order, strictly head of line; none after a
  //    preemption (it would take back the blocks just freed).
  if (!preempted) {
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (static_cast<int32_t>(running_.size()) >= cfg_.max_num_seqs || budget < 1) break;
      Sequence* s = it->second;
      StepEntry e;
      if (!admit_waiting(s, budget, e)) break;
      it = waiting_.erase(it);
      s->status = SeqStatus::kRunning;
      insert_running(s);
      budget -= e.q;
      out->entries.push_back(e);
      drafts.push_back(e.unknown_inputs ? nullptr : s->draft_tokens.data());
    }
  }

  fill_arrays(*out, drafts);
  out->loads.swap(pending_loads_);
  pending_loads_.clear();
  if (cfg_.report_evictions) {
    out->evicted = bm_.take_evicted();
    st_.num_evicted_blocks += static_cast<int64_t>(out->evicted.size());
  }
  double now = -1.0;
  for (StepEntry& e : out->entries) {
    Sequence* s = e.seq;
    s->inflight_q += e.q;
    s->inflight_emit += e.emit;
    ++s->inflight_refs;
    if (!e.prefill && !e.unknown_inputs) s->draft_tokens.clear();  // consumed
    if (s->first_scheduled_time < 0) {
      if (now < 0) now = monotonic_seconds();
      s->first_scheduled_time = now;
    }
  }
  ++st_.num_steps;
  st_.last_num_seqs = out->num_seqs();
  st_.last_num_batched_tokens = out->num_batched_tokens;
  st_.last_num_prefill_tokens = 0;
  for (const StepEntry& e : out->entries) {
    if (e.prefill) st_.last_num_prefill_tokens += e.q;
  }
  // An empty step carries nothing to process: it is not counted as unprocessed (updating it is
  // optional and only collects finishes reported outside update_from_output).
  if (!out->entries.empty()) {
    out->tracked = true;
    inflight_.push_back(out);
  }
  return out;
}

void Scheduler::fill_arrays(StepOutput& out, const std::vector<const int32_t*>& drafts) {
  const int32_t n = out.num_seqs();
  const int32_t bs = cfg_.block_size;
  const StepOutput* prev = inflight_.empty() ? nullptr : inflight_.back().get();
  int32_t total = 0, width = 0;
  for (StepEntry& e : out.entries) {
    e.token_offset = total;
    total += e.q;
    width = std::max(width, cdiv(e.start + e.q, bs));
  }
  out.num_batched_tokens = total;
  out.table_width = width;
  out.seq_ids.resize(n);
  out.query_start_loc.resize(n + 1);
  out.query_lens.resize(n);
  out.start_positions.resize(n);
  out.seq_lens.resize(n);
  out.prompt_lens.resize(n);
  out.num_drafts.resize(n);
  out.is_prefill.resize(n);
  out.emits_tokens.resize(n);
  out.prev_rows.resize(n);
  out.positions.resize(total);
  out.input_ids.resize(total);
  out.slot_mapping.resize(total);
  out.block_tables.assign(static_cast<size_t>(n) * width, -1);
  out.logits_indices.clear();
  out.logits_lens.assign(n, 0);
  out.logits_indices.reserve(total);
  out.query_start_loc[0] = 0;
  for (int32_t i = 0; i < n; ++i) {
    StepEntry& e = out.entries[i];
    Sequence* s = e.seq;
    out.seq_ids[i] = s->seq_id;
    out.query_start_loc[i + 1] = e.token_offset + e.q;
    out.query_lens[i] = e.q;
    out.start_positions[i] = e.start;
    out.seq_lens[i] = e.start + e.q;
    out.prompt_lens[i] = s->num_prompt_tokens;
    out.num_drafts[i] = e.num_drafts;
    out.is_prefill[i] = e.prefill;
    out.emits_tokens[i] = e.emit > 0;
    out.prev_rows[i] = (prev && s->last_step_id == prev->step_id) ? s->last_step_row : -1;
    s->last_step_id = out.step_id;
    s->last_step_row = i;
    out.any_prefill |= e.prefill;
    out.has_unknown_inputs |= e.unknown_inputs;
    const int32_t len = s->len();
    const int32_t* table = s->block_table.data();
    const int32_t* d = drafts[i];
    for (int32_t j = 0; j < e.q; ++j) {
      const int32_t p = e.start + j, t = e.token_offset + j;
      out.positions[t] = p;
      out.input_ids[t] = p < len ? s->tokens[p] : (d ? d[p - len] : -1);
      out.slot_mapping[t] = static_cast<int64_t>(table[p / bs]) * bs + (p % bs);
    }
    std::copy(table, table + cdiv(e.start + e.q, bs), out.block_tables.begin() + static_cast<size_t>(i) * width);
    if (e.emit > 0) {
      out.logits_lens[i] = e.prefill ? 1 : e.q;
      for (int32_t j = e.prefill ? e.q - 1 : 0; j < e.q; ++j) out.logits_indices.push_back(e.token_offset + j);
    }
  }
}

}  // namespace deepinfer
