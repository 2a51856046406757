// Scheduler::update_from_output() and reconcile(): committing a step's sampled tokens.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "deepinfer/scheduler.hpp"
#include "util.hpp"

namespace deepinfer {

using detail::bad;
using detail::cdiv;
using detail::S;

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

}  // namespace deepinfer
