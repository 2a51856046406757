// The continuous-batching scheduler: waiting queue, running set, per-step token and sequence
// budgets, chunked prefill, draft verification, preemption by recompute, and the step output that
// the model runner turns into tensors.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <deque>
#include <unordered_map>
#include <utility>
#include <vector>

#include "deepinfer/block_manager.hpp"
#include "deepinfer/sequence.hpp"

namespace deepinfer {

struct SchedulerConfig {
  int32_t block_size = 128;
  int32_t num_blocks = 0;
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 8192;
  int32_t max_model_len = 8192;
  bool enable_prefix_caching = true;
  bool enable_chunked_prefill = true;
  EngineType engine_type = EngineType::kNormal;
  // Drafts assumed per sequence when scheduling ahead of an unprocessed step (their ids are not
  // known yet); also the most drafts one step verifies.
  int32_t num_speculative_tokens = 0;
  // Bits kept of each prefix-cache key (64 = all); fewer force hash collisions in tests.
  int32_t prefix_hash_bits = 64;
  // Finish a preempted sequence (reason kPreempted, with the tokens it has) instead of recomputing
  // it later; a COMPLETION engine always does, having no prefill to recompute with.
  bool finish_preempted = false;
  // Report the cached blocks each schedule() evicts (StepOutput::evicted), for a lower KV tier.
  bool report_evictions = false;

  // Throws std::invalid_argument naming the field and the allowed range.
  void validate() const;
};

// One scheduled sequence in a step.
struct StepEntry {
  Sequence* seq = nullptr;
  uint32_t epoch = 0;
  int32_t start = 0;       // first query position (= tokens with KV before the step)
  int32_t q = 0;           // query tokens
  int32_t num_drafts = 0;  // drafts among the query tokens (decode only)
  int32_t emit = 0;        // tokens the step is assumed to emit (all drafts accepted)
  bool prefill = false;
  bool unknown_inputs = false;  // token ids come from an unprocessed step (async scheduling)
  int32_t token_offset = 0;     // first row in the flat per-token arrays
};

// A block whose entries a lower KV tier holds: the engine writes them into `block_id` before the step
// runs (the scheduler counts its tokens as computed). `index`: the block's position in the sequence.
struct BlockLoad {
  int64_t seq_id = 0;
  int32_t index = 0;
  int32_t block_id = -1;
  BlockKey key;
};

// What one schedule() decided, as flat arrays ready to become tensors. Immutable once built (numpy
// views borrow its storage).
struct StepOutput {
  int64_t step_id = 0;
  bool superseded = false;  // replaced by Scheduler::reconcile
  bool tracked = false;     // counted as unprocessed (empty steps are not)
  std::vector<StepEntry> entries;

  std::vector<int64_t> seq_ids;
  std::vector<int32_t> query_start_loc;  // [n + 1], cumulative query lengths
  std::vector<int32_t> query_lens;       // [n]
  std::vector<int32_t> start_positions;  // [n] tokens with KV before this step
  std::vector<int32_t> seq_lens;         // [n] context length after this step
  // [n] the request's original prompt length: unchanged by preemption and recompute (whose prompt is
  // then prompt + output so far), what a per-prompt rule such as YOCO truncation is keyed on
  std::vector<int32_t> prompt_lens;
  std::vector<int32_t> num_drafts;       // [n]
  std::vector<uint8_t> is_prefill;       // [n]
  std::vector<uint8_t> emits_tokens;     // [n] 0 for a non-final prefill chunk
  std::vector<int32_t> prev_rows;        // [n] row in the unprocessed previous step, -1 if none
  std::vector<int32_t> positions;        // [T]
  std::vector<int32_t> input_ids;        // [T], -1 where produced by the unprocessed previous step
  std::vector<int64_t> slot_mapping;     // [T] block_id * block_size + offset
  std::vector<int32_t> block_tables;     // [n, table_width], padded with -1
  // Token rows whose logits are sampled: every row of a decode / verification, the last row of a
  // chunk that ends its prompt, none for other chunks.
  std::vector<int32_t> logits_indices;
  std::vector<int32_t> logits_lens;  // [n] rows sampled per sequence (0, 1 or query_len)
  int32_t table_width = 0;
  int32_t num_batched_tokens = 0;
  bool any_prefill = false;
  bool has_unknown_inputs = false;
  std::vector<int64_t> preempted_seq_ids;
  // KV tier transfers of this schedule() call, before the step's forward and in this order: fetch the
  // loads' entries from the tier (storing evicted blocks may push them out), read the evicted blocks'
  // entries out of the pools (which still hold them; a load may target one of them), then write the
  // loads in. They belong to the call: reconcile() does not carry them over.
  std::vector<EvictedBlock> evicted;
  std::vector<BlockLoad> loads;

  int32_t num_seqs() const { return static_cast<int32_t>(entries.size()); }
};

struct FinishedSeq {
  int64_t seq_id;
  FinishReason reason;
};

struct SchedulerStats {
  int32_t num_waiting = 0, num_running = 0;
  int32_t num_blocks = 0, num_free_blocks = 0, num_cached_free_blocks = 0;
  int64_t prefix_query_tokens = 0, prefix_hit_tokens = 0, tier_hit_tokens = 0, num_evicted_blocks = 0;
  int64_t num_preemptions = 0, num_steps = 0, num_finished = 0, num_aborted = 0;
  int32_t last_num_seqs = 0, last_num_batched_tokens = 0, last_num_prefill_tokens = 0;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);
  ~Scheduler();

  const SchedulerConfig& config() const { return cfg_; }

  // Validates and queues a request. seq_id < 0 picks the next free id. cached_blocks: COMPLETION
  // engines only, the blocks that already hold the prompt's KV. cache_salt: prefix-cache namespace
  // (0 = shared by all; otherwise < 2^63). Returns the seq id.
  int64_t add_request(int64_t seq_id, const int32_t* prompt, int32_t prompt_len, const RequestLimits& limits,
                      int32_t priority, double arrival_time, const int32_t* cached_blocks,
                      int32_t num_cached_blocks, uint64_t cache_salt = 0);
  // Marks a request aborted and frees its blocks. False if it had already finished.
  bool abort(int64_t seq_id);
  // Forgets a finished request (and frees the blocks a PROMPT engine handed back).
  void release(int64_t seq_id);
  void set_draft_tokens(int64_t seq_id, const int32_t* tokens, int32_t n);

  std::shared_ptr<StepOutput> schedule();
  // sampled: flat token ids; counts[i] tokens belong to the i-th scheduled sequence.
  std::vector<FinishedSeq> update_from_output(const StepOutput& out, const int32_t* sampled,
                                              const int32_t* counts, int32_t num_counts, int64_t num_sampled);
  // Rebuilds the one unprocessed step (scheduled ahead) with exact inputs after the step before it
  // was processed: drops sequences that finished, fixes positions and token ids.
  std::shared_ptr<StepOutput> reconcile(const std::shared_ptr<StepOutput>& out);

  const Sequence& get(int64_t seq_id) const;
  bool has_unfinished() const { return num_unfinished_ > 0; }
  int32_t num_unfinished() const { return num_unfinished_; }
  int32_t num_inflight_steps() const { return static_cast<int32_t>(inflight_.size()); }
  SchedulerStats stats() const;
  const BlockManager& block_manager() const { return bm_; }
  // Keys a lower KV tier holds (the engine keeps this in step with its tier): a waiting request's
  // blocks past its device-cache hit whose keys are loadable are loaded instead of computed.
  void add_loadable(const BlockKey& key) { bm_.add_loadable(key); }
  void drop_loadable(const BlockKey& key) { bm_.drop_loadable(key); }
  size_t num_loadable() const { return bm_.num_loadable(); }
  // A load that could not be done: forget the block's cached content so no request hits it.
  void uncache_block(int32_t block_id) { bm_.uncache(block_id); }
  // Sends a running sequence of `out` (the latest unprocessed step) back to waiting, as a preemption
  // does: its blocks are freed and its entry in `out` goes stale (reconcile drops it); it recomputes
  // when admitted again. For a lower-tier load that failed after schedule(). Returns false (and does
  // nothing) where a preempted sequence would finish instead: finish_preempted, COMPLETION engines.
  bool requeue(int64_t seq_id, StepOutput& out);
  std::vector<int64_t> waiting_ids() const;
  std::vector<int64_t> running_ids() const;
  std::vector<int64_t> live_ids() const;  // every known, unreleased sequence
  // Throws std::logic_error on the first broken invariant (tests call it after every step).
  void check_invariants() const;

 private:
  using Key = std::pair<int32_t, int64_t>;  // (priority, arrival_order)
  static Key key_of(const Sequence* s) { return {s->priority, s->arrival_order}; }

  Sequence* find(int64_t seq_id) const;
  Sequence* lookup(int64_t seq_id, const char* op) const;
  // Plans the next query of a sequence given `budget` tokens; returns false when it cannot run.
  bool plan(Sequence* s, int32_t budget, StepEntry& e) const;
  bool admit_waiting(Sequence* s, int32_t budget, StepEntry& e);
  bool ensure_blocks(Sequence* s, int32_t num_tokens);
  void preempt(Sequence* s, StepOutput& out);
  void insert_running(Sequence* s);
  void erase_running(Sequence* s);
  void finish(Sequence* s, FinishReason reason, std::vector<FinishedSeq>* finished);
  void register_blocks(Sequence* s);
  void unref(Sequence* s);
  void fill_arrays(StepOutput& out, const std::vector<const int32_t*>& drafts);
  void check_stop(Sequence* s, int32_t token, FinishReason& reason) const;

  SchedulerConfig cfg_;
  BlockManager bm_;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> seqs_;
  std::map<Key, Sequence*> waiting_;
  std::vector<Sequence*> running_;  // sorted by Key
  std::deque<std::shared_ptr<StepOutput>> inflight_;
  // Finished while scheduling (a preemption that finishes); reported by the next update.
  std::vector<FinishedSeq> finished_in_schedule_;
  int64_t next_step_id_ = 0, next_arrival_ = 0, next_auto_id_ = 0;
  int32_t num_unfinished_ = 0;
  SchedulerStats st_;
  // Scratch buffers reused across steps.
  std::vector<int32_t> hit_blocks_;
  PrefixChain hit_chain_;
  std::vector<BlockLoad> pending_loads_;  // admitted this schedule(), handed to its output
};

double monotonic_seconds();

}  // namespace deepinfer
