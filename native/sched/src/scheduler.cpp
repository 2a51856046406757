#include "deepinfer/scheduler.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace deepinfer {

namespace {

std::string S(int64_t v) { return std::to_string(v); }

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }

inline int32_t cdiv(int32_t a, int32_t b) { return (a + b - 1) / b; }

}  // namespace

double monotonic_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kMaxModelLen: return "max_model_len";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kPrefilled: return "prefilled";
    case FinishReason::kPreempted: return "preempted";
  }
  return "";
}

void SchedulerConfig::validate() const {
  if (block_size < 1 || block_size > 4096 || (block_size & (block_size - 1)) != 0) {
    bad("block_size must be a power of two in [1, 4096], got " + S(block_size));
  }
  if (max_model_len < 2) bad("max_model_len must be >= 2, got " + S(max_model_len));
  int32_t min_blocks = cdiv(max_model_len, block_size);
  if (num_blocks < min_blocks) {
    bad("num_blocks must be >= ceil(max_model_len / block_size) = " + S(min_blocks) +
        " so that one sequence of max_model_len tokens fits, got " + S(num_blocks));
  }
  if (max_num_seqs < 1) bad("max_num_seqs must be >= 1, got " + S(max_num_seqs));
  if (max_num_batched_tokens < block_size) {
    bad("max_num_batched_tokens must be >= block_size (" + S(block_size) + "), got " +
        S(max_num_batched_tokens));
  }
  if (!enable_chunked_prefill && max_num_batched_tokens < max_model_len) {
    bad("max_num_batched_tokens must be >= max_model_len (" + S(max_model_len) +
        ") when enable_chunked_prefill is off, got " + S(max_num_batched_tokens));
  }
  if (num_speculative_tokens < 0 || num_speculative_tokens >= max_num_batched_tokens) {
    bad("num_speculative_tokens must be in [0, max_num_batched_tokens), got " + S(num_speculative_tokens));
  }
  if (prefix_hash_bits < 0 || prefix_hash_bits > 64) {
    bad("prefix_hash_bits must be in [0, 64], got " + S(prefix_hash_bits));
  }
  if (engine_type != EngineType::kNormal && engine_type != EngineType::kPrompt &&
      engine_type != EngineType::kCompletion) {
    bad("engine_type must be NORMAL, PROMPT or COMPLETION");
  }
}

Scheduler::Scheduler(const SchedulerConfig& config)
    : cfg_((config.validate(), config)),
      bm_(config.num_blocks, config.block_size,
          config.enable_prefix_caching && config.engine_type != EngineType::kCompletion, config.prefix_hash_bits) {
  st_.num_blocks = cfg_.num_blocks;
}

Scheduler::~Scheduler() = default;

Sequence* Scheduler::find(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end() || it->second->release_pending) return nullptr;
  return it->second.get();
}

Sequence* Scheduler::lookup(int64_t seq_id, const char* op) const {
  Sequence* s = find(seq_id);
  if (!s) bad(std::string(op) + ": seq_id " + S(seq_id) + " is unknown (never added, or released)");
  return s;
}

const Sequence& Scheduler::get(int64_t seq_id) const { return *lookup(seq_id, "get"); }

int64_t Scheduler::add_request(int64_t seq_id, const int32_t* prompt, int32_t prompt_len,
                               const RequestLimits& limits, int32_t priority, double arrival_time,
                               const int32_t* cached_blocks, int32_t num_cached_blocks) {
  // Validate everything before touching any state, so a bad request leaves no trace.
  if (prompt_len < 1) bad("prompt_token_ids must not be empty");
  if (prompt_len >= cfg_.max_model_len) {
    bad("prompt_token_ids has " + S(prompt_len) + " tokens; it must be at most max_model_len - 1 = " +
        S(cfg_.max_model_len - 1));
  }
  for (int32_t i = 0; i < prompt_len; ++i) {
    if (prompt[i] < 0) bad("prompt_token_ids must be >= 0, got " + S(prompt[i]) + " at index " + S(i));
  }
  if (limits.max_tokens < 1) bad("max_tokens must be >= 1, got " + S(limits.max_tokens));
  if (limits.min_tokens < 0 || limits.min_tokens > limits.max_tokens) {
    bad("min_tokens must be in [0, max_tokens=" + S(limits.max_tokens) + "], got " + S(limits.min_tokens));
  }
  for (int32_t t : limits.stop_token_ids) {
    if (t < 0) bad("stop_token_ids must be >= 0, got " + S(t));
  }
  if (limits.eos_token_id < -1) bad("eos_token_id must be >= 0 (or -1 for none), got " + S(limits.eos_token_id));
  if (seq_id >= 0 && seqs_.count(seq_id)) bad("seq_id " + S(seq_id) + " is already in use");
  if (seq_id < -1) bad("seq_id must be >= 0 (or None for automatic), got " + S(seq_id));
  bool completion = cfg_.engine_type == EngineType::kCompletion;
  if (completion) {
    int32_t need = cdiv(prompt_len, cfg_.block_size);
    if (num_cached_blocks != need) {
      bad("cached_block_ids must hold ceil(len(prompt_token_ids) / block_size) = " + S(need) +
          " blocks on a COMPLETION engine, got " + S(num_cached_blocks));
    }
    for (int32_t i = 0; i < num_cached_blocks; ++i) {
      int32_t b = cached_blocks[i];
      if (b < 0 || b >= cfg_.num_blocks) {
        bad("cached_block_ids must be in [0, " + S(cfg_.num_blocks) + "), got " + S(b));
      }
      if (!bm_.allocator().is_free(b)) bad("cached_block_ids: block " + S(b) + " is already in use");
      for (int32_t j = 0; j < i; ++j) {
        if (cached_blocks[j] == b) bad("cached_block_ids: block " + S(b) + " is listed twice");
      }
    }
  } else if (num_cached_blocks > 0) {
    bad("cached_block_ids is only accepted by a COMPLETION engine");
  }

  if (seq_id < 0) {
    while (seqs_.count(next_auto_id_)) ++next_auto_id_;
    seq_id = next_auto_id_++;
  }
  auto owned = std::make_unique<Sequence>();
  Sequence* s = owned.get();
  s->seq_id = seq_id;
  s->priority = priority;
  s->arrival_order = next_arrival_++;
  s->tokens.reserve(static_cast<size_t>(prompt_len) +
                    std::min<int64_t>(limits.max_tokens, cfg_.max_model_len - prompt_len) + 1);
  s->tokens.assign(prompt, prompt + prompt_len);
  s->num_prompt_tokens = prompt_len;
  s->limits = limits;
  s->arrival_time = arrival_time >= 0 ? arrival_time : monotonic_seconds();
  if (completion) {
    for (int32_t i = 0; i < num_cached_blocks; ++i) {
      bm_.take(cached_blocks[i]);
      s->block_table.push_back(cached_blocks[i]);
    }
    // The prompt's KV is there; the last prompt token is fed again as the first decode query so
    // that its logits (which produce the first output token) are computed here.
    s->num_computed = prompt_len - 1;
  }
  seqs_.emplace(seq_id, std::move(owned));
  waiting_.emplace(key_of(s), s);
  ++num_unfinished_;
  return seq_id;
}

void Scheduler::set_draft_tokens(int64_t seq_id, const int32_t* tokens, int32_t n) {
  Sequence* s = lookup(seq_id, "set_draft_tokens");
  if (cfg_.num_speculative_tokens > 0 && n > cfg_.num_speculative_tokens) {
    bad("draft_token_ids has " + S(n) + " tokens; at most num_speculative_tokens = " +
        S(cfg_.num_speculative_tokens) + " are verified per step");
  }
  for (int32_t i = 0; i < n; ++i) {
    if (tokens[i] < 0) bad("draft_token_ids must be >= 0, got " + S(tokens[i]));
  }
  if (s->finished()) return;
  s->draft_tokens.assign(tokens, tokens + n);
}

void Scheduler::insert_running(Sequence* s) {
  auto pos = std::upper_bound(running_.begin(), running_.end(), s,
                              [](const Sequence* a, const Sequence* b) { return key_of(a) < key_of(b); });
  running_.insert(pos, s);
}

void Scheduler::erase_running(Sequence* s) {
  auto it = std::find(running_.rbegin(), running_.rend(), s);
  if (it != running_.rend()) running_.erase(std::next(it).base());
}

void Scheduler::register_blocks(Sequence* s) {
  if (!bm_.prefix_caching()) return;
  int32_t full = std::min(s->num_computed, s->len()) / cfg_.block_size;
  full = std::min<int32_t>(full, static_cast<int32_t>(s->block_table.size()));
  if (full > static_cast<int32_t>(s->chain.size())) {
    bm_.register_full_blocks(s->tokens.data(), full, s->block_table, s->chain);
  }
}

void Scheduler::finish(Sequence* s, FinishReason reason, std::vector<FinishedSeq>* finished) {
  SeqStatus old = s->status;
  s->status = SeqStatus::kFinished;
  s->finish_reason = reason;
  s->finished_time = monotonic_seconds();
  if (old == SeqStatus::kRunning) {
    erase_running(s);
  } else {
    waiting_.erase(key_of(s));
  }
  if (reason == FinishReason::kPrefilled) {
    s->holds_blocks_after_finish = true;
  } else {
    register_blocks(s);
    bm_.free_table(s->block_table);
    s->block_table.clear();
  }
  s->chain.clear();
  s->draft_tokens.clear();
  s->inflight_q = s->inflight_emit = 0;
  --num_unfinished_;
  ++st_.num_finished;
  if (reason == FinishReason::kAbort) ++st_.num_aborted;
  if (finished) finished->push_back({s->seq_id, reason});
}

bool Scheduler::abort(int64_t seq_id) {
  Sequence* s = lookup(seq_id, "abort");
  if (s->finished()) return false;
  finish(s, FinishReason::kAbort, nullptr);
  return true;
}

void Scheduler::release(int64_t seq_id) {
  Sequence* s = lookup(seq_id, "release");
  if (!s->finished()) bad("release: seq_id " + S(seq_id) + " has not finished (abort it first)");
  if (s->holds_blocks_after_finish) {
    register_blocks(s);
    bm_.free_table(s->block_table);
    s->block_table.clear();
    s->holds_blocks_after_finish = false;
  }
  if (s->inflight_refs > 0) {
    s->release_pending = true;  // a step output still points at it; erased when that is processed
  } else {
    seqs_.erase(seq_id);
  }
}

void Scheduler::unref(Sequence* s) {
  if (--s->inflight_refs == 0 && s->release_pending) seqs_.erase(s->seq_id);
}

void Scheduler::preempt(Sequence* s, StepOutput& out) {
  ++st_.num_preemptions;
  ++s->num_preemptions;
  out.preempted_seq_ids.push_back(s->seq_id);
  if (cfg_.engine_type == EngineType::kCompletion) {
    // Recompute would need a prefill, which a decode-only engine cannot run.
    finish(s, FinishReason::kPreempted, &finished_in_schedule_);
    return;
  }
  erase_running(s);
  register_blocks(s);  // what it computed stays reusable through the prefix cache
  bm_.free_table(s->block_table);
  s->block_table.clear();
  s->chain.clear();
  s->draft_tokens.clear();
  s->num_computed = 0;
  s->inflight_q = s->inflight_emit = 0;
  ++s->epoch;  // results of a step still in flight for it are dropped
  s->status = SeqStatus::kPreempted;
  waiting_.emplace(key_of(s), s);
}

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
  int32_t free_hits = bm_.match_prefix(s->tokens.data(), max_hit_blocks, hit_blocks_, hit_chain_);
  int32_t start = static_cast<int32_t>(hit_blocks_.size()) * cfg_.block_size;
  int32_t rest = len - start;
  int32_t q = std::min(rest, budget);
  if (!cfg_.enable_chunked_prefill && q < rest) return false;
  int32_t fresh = cdiv(start + q, cfg_.block_size) - static_cast<int32_t>(hit_blocks_.size());
  if (fresh > bm_.num_free() - free_hits) return false;
  bm_.claim_cached(hit_blocks_);
  s->block_table = hit_blocks_;
  for (int32_t i = 0; i < fresh; ++i) s->block_table.push_back(bm_.allocate());
  s->chain = hit_chain_;
  s->num_computed = start;
  s->num_cached_tokens = start;
  st_.prefix_query_tokens += len;
  st_.prefix_hit_tokens += start;
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
  out.num_drafts.resize(n);
  out.is_prefill.resize(n);
  out.emits_tokens.resize(n);
  out.prev_rows.resize(n);
  out.positions.resize(total);
  out.input_ids.resize(total);
  out.slot_mapping.resize(total);
  out.block_tables.assign(static_cast<size_t>(n) * width, -1);
  out.logits_indices.clear();
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
      for (int32_t j = e.prefill ? e.q - 1 : 0; j < e.q; ++j) out.logits_indices.push_back(e.token_offset + j);
    }
  }
}

void Scheduler::check_stop(Sequence* s, int32_t token, FinishReason& reason) const {
  const RequestLimits& l = s->limits;
  const int32_t out = s->num_output();
  if (out > l.min_tokens) {
    bool stop = (!l.ignore_eos && l.eos_token_id >= 0 && token == l.eos_token_id);
    if (!stop) {
      for (int32_t t : l.stop_token_ids) {
        if (t == token) {
          stop = true;
          break;
        }
      }
    }
    if (stop) {
      s->stop_token_id = token;
      reason = FinishReason::kStop;
      return;
    }
  }
  if (out >= l.max_tokens) {
    reason = FinishReason::kLength;
  } else if (s->len() >= cfg_.max_model_len) {
    reason = FinishReason::kMaxModelLen;
  }
}

std::vector<FinishedSeq> Scheduler::update_from_output(const StepOutput& out, const int32_t* sampled,
                                                       const int32_t* counts, int32_t num_counts,
                                                       int64_t num_sampled) {
  if (out.superseded) bad("update_from_output: this step output was replaced by reconcile(); pass that one");
  if (!out.tracked && out.entries.empty()) {
    if (num_counts != 0 || num_sampled != 0) bad("update_from_output: the step is empty; no tokens expected");
    std::vector<FinishedSeq> finished;
    finished.swap(finished_in_schedule_);
    return finished;
  }
  if (inflight_.empty() || inflight_.front().get() != &out) {
    bad("update_from_output: step outputs must be processed once each, in the order schedule() returned them");
  }
  const int32_t n = out.num_seqs();
  if (num_counts != n) {
    bad("update_from_output: expected sampled tokens for " + S(n) + " scheduled sequences, got " + S(num_counts));
  }
  // Validate everything first: a malformed output must not leave half-applied state behind.
  int64_t total = 0;
  for (int32_t i = 0; i < n; ++i) {
    const StepEntry& e = out.entries[i];
    const int32_t c = counts[i];
    if (c < 0) bad("update_from_output: negative token count for seq " + S(e.seq->seq_id));
    const bool live = e.epoch == e.seq->epoch && !e.seq->finished();
    if (live && e.emit > 0) {
      const int32_t max_c = e.prefill ? 1 : e.q;
      const int32_t min_c = (e.prefill && cfg_.engine_type == EngineType::kPrompt) ? 0 : 1;
      if (c < min_c || c > max_c) {
        bad("update_from_output: seq " + S(e.seq->seq_id) + " must receive between " + S(min_c) + " and " + S(max_c) +
            " sampled tokens (accepted drafts + 1), got " + S(c));
      }
      for (int32_t j = 0; j < (e.prefill ? std::min(c, 1) : c); ++j) {
        if (sampled[total + j] < 0) {
          bad("update_from_output: seq " + S(e.seq->seq_id) + " got a negative token id (" +
              S(sampled[total + j]) + ")");
        }
      }
      for (int32_t j = 0; j + 1 < c; ++j) {  // accepted drafts must be the drafts that were fed
        const int32_t fed = out.input_ids[e.token_offset + 1 + j];
        if (fed >= 0 && fed != sampled[total + j]) {
          bad("update_from_output: seq " + S(e.seq->seq_id) + " token " + S(j) + " (" +
              S(sampled[total + j]) + ") is not the draft it claims to accept (" + S(fed) + ")");
        }
      }
    }
    total += c;
  }
  if (total != num_sampled) {
    bad("update_from_output: counts sum to " + S(total) + " but " + S(num_sampled) + " tokens were given");
  }
  auto keep = inflight_.front();  // `out` stays valid while we work
  inflight_.pop_front();
  keep->tracked = false;

  std::vector<FinishedSeq> finished;
  finished.swap(finished_in_schedule_);
  double now = -1.0;
  int64_t off = 0;
  for (int32_t i = 0; i < n; ++i) {
    const StepEntry& e = out.entries[i];
    Sequence* s = e.seq;
    const int32_t* toks = sampled + off;
    const int32_t c = counts[i];
    off += c;
    if (e.epoch != s->epoch || s->finished()) {  // preempted or aborted meanwhile: drop its results
      unref(s);
      continue;
    }
    s->inflight_q -= e.q;
    s->inflight_emit -= e.emit;
    if (e.emit == 0) {  // a prompt chunk that does not end the prompt
      s->num_computed += e.q;
      register_blocks(s);
      unref(s);
      continue;
    }
    if (e.prefill) {
      s->num_computed += e.q;
    } else {
      s->num_computed += c;  // the fed token plus the accepted drafts now have committed KV
    }
    FinishReason reason = FinishReason::kNone;
    const int32_t take = e.prefill ? std::min(c, 1) : c;
    if (take == 0) reason = FinishReason::kPrefilled;  // PROMPT engine that samples nothing
    for (int32_t j = 0; j < take; ++j) {
      s->tokens.push_back(toks[j]);
      if (s->first_token_time < 0) {
        if (now < 0) now = monotonic_seconds();
        s->first_token_time = now;
      }
      if (cfg_.engine_type == EngineType::kPrompt && e.prefill) {
        reason = FinishReason::kPrefilled;
        break;
      }
      check_stop(s, toks[j], reason);
      if (reason != FinishReason::kNone) break;
    }
    s->num_computed = std::min(s->num_computed, s->len());
    if (reason != FinishReason::kNone) {
      register_blocks(s);
      finish(s, reason, &finished);
    } else {
      register_blocks(s);
    }
    unref(s);
  }
  return finished;
}

std::shared_ptr<StepOutput> Scheduler::reconcile(const std::shared_ptr<StepOutput>& ptr) {
  if (!ptr) bad("reconcile: sched_output must be a SchedulerOutput, got None");
  const StepOutput& out = *ptr;
  if (out.superseded) bad("reconcile: this step output was already replaced by reconcile()");
  if (!out.tracked && out.entries.empty()) return ptr;  // nothing to fix in an empty step
  if (inflight_.size() != 1 || inflight_.front().get() != &out) {
    bad("reconcile: only the single unprocessed step can be reconciled, after update_from_output of the "
        "step before it");
  }
  auto fresh = std::make_shared<StepOutput>();
  fresh->step_id = out.step_id;
  fresh->preempted_seq_ids = out.preempted_seq_ids;
  std::vector<const int32_t*> drafts;
  std::vector<Sequence*> consumed;  // their drafts (set after the previous step) are used now
  for (const StepEntry& old : out.entries) {
    Sequence* s = old.seq;
    if (old.epoch != s->epoch || s->finished()) {
      unref(s);
      continue;
    }
    StepEntry e = old;
    e.start = s->num_computed;
    const int32_t* d = nullptr;
    if (!old.prefill) {
      const int32_t vout = s->num_output();
      int32_t k = old.num_drafts;
      if (old.unknown_inputs) {
        k = std::min<int32_t>(k, static_cast<int32_t>(s->draft_tokens.size()));
        d = s->draft_tokens.data();
        consumed.push_back(s);
      } else {
        d = out.input_ids.data() + old.token_offset + 1;
      }
      k = std::min({k, s->limits.max_tokens - vout - 1, cfg_.max_model_len - s->len() - 1});
      e.num_drafts = std::max(k, 0);
      e.q = 1 + e.num_drafts;
      e.emit = e.q;
    }
    e.unknown_inputs = false;
    s->inflight_q += e.q - old.q;
    s->inflight_emit += e.emit - old.emit;
    // Blocks were reserved for the assumed (longer) sequence, so they cover the exact one.
    fresh->entries.push_back(e);
    drafts.push_back(d);
  }
  // Rows are matched against the previous step by sequence, which is processed now.
  for (StepEntry& e : fresh->entries) e.seq->last_step_id = -1;
  inflight_.pop_front();
  fill_arrays(*fresh, drafts);
  for (Sequence* s : consumed) s->draft_tokens.clear();
  ptr->superseded = true;
  ptr->tracked = false;
  if (fresh->entries.empty()) return fresh;  // everything finished meanwhile: nothing to process
  fresh->tracked = true;
  inflight_.push_back(fresh);
  return fresh;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats st = st_;
  st.num_waiting = static_cast<int32_t>(waiting_.size());
  st.num_running = static_cast<int32_t>(running_.size());
  st.num_free_blocks = bm_.num_free();
  st.num_cached_free_blocks = bm_.num_cached_free();
  return st;
}

std::vector<int64_t> Scheduler::waiting_ids() const {
  std::vector<int64_t> ids;
  for (const auto& kv : waiting_) ids.push_back(kv.second->seq_id);
  return ids;
}

std::vector<int64_t> Scheduler::running_ids() const {
  std::vector<int64_t> ids;
  for (const Sequence* s : running_) ids.push_back(s->seq_id);
  return ids;
}

std::vector<int64_t> Scheduler::live_ids() const {
  std::vector<int64_t> ids;
  for (const auto& kv : seqs_) {
    if (!kv.second->release_pending) ids.push_back(kv.first);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

void Scheduler::check_invariants() const {
  bm_.check_consistency();
  std::vector<int32_t> owners(cfg_.num_blocks, 0);
  int32_t unfinished = 0;
  for (const auto& kv : seqs_) {
    const Sequence* s = kv.second.get();
    for (int32_t b : s->block_table) ++owners[b];
    if (!s->finished()) ++unfinished;
    if (s->finished() && !s->holds_blocks_after_finish && !s->block_table.empty()) {
      throw std::logic_error("finished seq " + S(s->seq_id) + " still holds blocks");
    }
    const int32_t covered = static_cast<int32_t>(s->block_table.size()) * cfg_.block_size;
    if (!s->finished() && covered < s->num_computed + s->inflight_q) {
      throw std::logic_error("seq " + S(s->seq_id) + " block table covers " + S(covered) + " tokens < " +
                             S(s->num_computed + s->inflight_q));
    }
    if (s->num_computed > s->len()) throw std::logic_error("seq " + S(s->seq_id) + " computed > len");
    if (s->status == SeqStatus::kRunning &&
        std::find(running_.begin(), running_.end(), s) == running_.end()) {
      throw std::logic_error("seq " + S(s->seq_id) + " is RUNNING but not in the running set");
    }
    if ((s->status == SeqStatus::kWaiting || s->status == SeqStatus::kPreempted) && !waiting_.count(key_of(s))) {
      throw std::logic_error("seq " + S(s->seq_id) + " is waiting but not queued");
    }
  }
  for (int32_t b = 0; b < cfg_.num_blocks; ++b) {
    if (owners[b] != bm_.ref_count(b)) {
      throw std::logic_error("block " + S(b) + " has ref count " + S(bm_.ref_count(b)) + " but " + S(owners[b]) +
                             " owners");
    }
    if (owners[b] > 1 && !bm_.is_cached(b)) {
      throw std::logic_error("block " + S(b) + " is shared but holds no cached prefix");
    }
  }
  if (unfinished != num_unfinished_) throw std::logic_error("unfinished count is off");
  if (static_cast<int32_t>(running_.size()) > cfg_.max_num_seqs) throw std::logic_error("too many running");
  if (!std::is_sorted(running_.begin(), running_.end(),
                      [](const Sequence* a, const Sequence* b) { return key_of(a) < key_of(b); })) {
    throw std::logic_error("running set is out of order");
  }
}

}  // namespace deepinfer
