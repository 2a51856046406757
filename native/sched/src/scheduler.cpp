// Scheduler: configuration, requests, lifetimes (finish / abort / release / preempt), views.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <chrono>

#include "deepinfer/scheduler.hpp"
#include "util.hpp"

namespace deepinfer {

using detail::bad;
using detail::cdiv;
using detail::S;

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
  bm_.set_report_evictions(cfg_.report_evictions);
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
                               const int32_t* cached_blocks, int32_t num_cached_blocks, uint64_t cache_salt) {
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
  if (cache_salt >> 63) bad("cache_salt must be in [0, 2^63), got " + std::to_string(cache_salt));
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
  s->chain.set_salt(cache_salt);
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

bool Scheduler::requeue(int64_t seq_id, StepOutput& out) {
  Sequence* s = lookup(seq_id, "requeue");
  bool latest = !inflight_.empty() && inflight_.back().get() == &out;
  if (!latest) bad("requeue: sched_output must be the latest step, not yet processed");
  if (s->status != SeqStatus::kRunning) bad("requeue: seq_id " + S(seq_id) + " is not running");
  if (cfg_.finish_preempted || cfg_.engine_type == EngineType::kCompletion) return false;
  preempt(s, out);
  return true;
}

void Scheduler::preempt(Sequence* s, StepOutput& out) {
  ++st_.num_preemptions;
  ++s->num_preemptions;
  out.preempted_seq_ids.push_back(s->seq_id);
  if (cfg_.finish_preempted || cfg_.engine_type == EngineType::kCompletion) {
    // Asked to, or it cannot recompute: recompute would need a prefill, which a decode-only engine
    // cannot run. Its results of a step still in flight are dropped (it has finished).
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
