// One request as the scheduler sees it: token ids, limits, status and KV bookkeeping.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "deepinfer/block_manager.hpp"

namespace deepinfer {

enum class SeqStatus : int8_t { kWaiting = 0, kRunning = 1, kPreempted = 2, kFinished = 3 };

enum class FinishReason : int8_t {
  kNone = 0,
  kStop = 1,         // EOS or one of the stop token ids was generated
  kLength = 2,       // max_tokens output tokens were generated
  kMaxModelLen = 3,  // the sequence reached max_model_len tokens
  kAbort = 4,        // abort() was called
  kPrefilled = 5,    // PROMPT engine: the prompt is in the KV cache (blocks handed back)
  kPreempted = 6,    // out of KV blocks and not recomputed (finish_preempted, or a COMPLETION engine)
};

const char* finish_reason_name(FinishReason r);

enum class EngineType : int8_t { kNormal = 0, kPrompt = 1, kCompletion = 2 };

struct RequestLimits {
  int32_t max_tokens = 16;
  int32_t min_tokens = 0;
  std::vector<int32_t> stop_token_ids;
  int32_t eos_token_id = -1;  // -1: none
  bool ignore_eos = false;
};

struct Sequence {
  int64_t seq_id = 0;
  int32_t priority = 0;       // smaller runs first
  int64_t arrival_order = 0;  // admission tie-break: earlier first (FIFO)
  std::vector<int32_t> tokens;  // committed tokens: prompt + outputs, never drafts
  int32_t num_prompt_tokens = 0;
  RequestLimits limits;

  SeqStatus status = SeqStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  int32_t stop_token_id = -1;  // the token that ended it (kStop)

  // KV bookkeeping. num_computed: leading tokens whose KV is written and committed.
  int32_t num_computed = 0;
  // Steps scheduled but not yet processed (at most two): their query tokens and the tokens they are
  // assumed to emit (all drafts accepted). The scheduler plans the next step from these.
  int32_t inflight_q = 0;
  int32_t inflight_emit = 0;
  int32_t inflight_refs = 0;  // step outputs that still point at this sequence
  uint32_t epoch = 0;         // bumped on preemption: results of older in-flight steps are dropped
  int64_t last_step_id = -1;  // step that scheduled it last, and its row there
  int32_t last_step_row = -1;
  std::vector<int32_t> block_table;
  PrefixChain chain;  // identity of its leading full blocks (prefix cache)
  std::vector<int32_t> draft_tokens;  // proposals to verify in the next step
  bool holds_blocks_after_finish = false;  // PROMPT engine hand-off
  bool release_pending = false;            // released by the caller while a step still points here

  // Metrics.
  int32_t num_cached_tokens = 0;  // prefix-cache hit at the latest admission
  int32_t num_preemptions = 0;
  double arrival_time = 0.0, first_scheduled_time = -1.0, first_token_time = -1.0, finished_time = -1.0;

  int32_t len() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_output() const { return len() - num_prompt_tokens; }
  bool finished() const { return status == SeqStatus::kFinished; }
};

}  // namespace deepinfer
