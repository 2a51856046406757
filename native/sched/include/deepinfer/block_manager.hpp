// Paged KV blocks with automatic prefix caching.
//
// A full block is identified by its content *and* everything before it: its key chains the
// previous block's key with its own token ids. Keys are 64-bit hashes, so two different prefixes can
// collide; a hit is therefore confirmed exactly: the candidate block must hold the same token ids and
// must have been registered as the child of the very block matched just before (each registration
// gets a never-reused id, `uid`). By induction a confirmed hit means the whole prefix is identical,
// so a collision can never reuse the wrong KV.
//
// Freed blocks that hold registered content stay in the cache until the allocator hands them out
// again; they are appended at the tail of the free list (evicted last, LRU), while freed blocks
// without reusable content go to the head (recycled first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "deepinfer/block_allocator.hpp"

namespace deepinfer {

inline constexpr uint64_t kPrefixRootHash = 0x9E3779B97F4A7C15ull;
inline constexpr uint64_t kPrefixRootCheck = 0xD6E8FEB86659FD93ull;

// A block's key outside the device cache (a lower KV tier): the chained hash and a second, independent
// 64-bit chain over the same prefix (never truncated by hash_bits), so that a key names one prefix.
struct BlockKey {
  uint64_t hash = 0;
  uint64_t check = 0;
  bool operator==(const BlockKey& o) const { return hash == o.hash && check == o.check; }
};
struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const { return static_cast<size_t>(k.hash ^ (k.check * 0x9E3779B97F4A7C15ull)); }
};

// A cached block whose content the allocator handed out for new KV: the engine may keep its entries
// in a lower tier under `key` (its pools still hold them until the step that reuses the block runs).
struct EvictedBlock {
  int32_t block_id = -1;
  BlockKey key;
  std::vector<int32_t> tokens;
};

// The identity of a run of full blocks: the chained hash (for lookups) and the uid of the block
// registered with that exact content (for exact confirmation). The chain starts at a root: the
// empty prefix (uid 0), or a request's cache salt. Two requests share cached blocks only when their
// salts are equal (e.g. an engine whose KV depends on more than the tokens, such as YoCo
// truncation keyed by prompt length). Salted roots use uids with the top bit set, which
// registration uids (a counter from 1) never reach, so exact confirmation keeps working.
struct PrefixChain {
  std::vector<uint64_t> hashes;
  std::vector<uint64_t> checks;
  std::vector<uint64_t> uids;
  uint64_t root_hash = kPrefixRootHash;
  uint64_t root_check = kPrefixRootCheck;
  uint64_t root_uid = 0;
  size_t size() const { return uids.size(); }
  // Forgets the blocks, keeps the root (the salt belongs to the request).
  void clear() {
    hashes.clear();
    checks.clear();
    uids.clear();
  }
  // salt 0 = unsalted; otherwise salt must be < 2^63.
  void set_salt(uint64_t salt);
  void copy_root(const PrefixChain& other) {
    root_hash = other.root_hash;
    root_check = other.root_check;
    root_uid = other.root_uid;
  }
  uint64_t last_hash() const;
  uint64_t last_check() const { return checks.empty() ? root_check : checks.back(); }
  uint64_t last_uid() const { return uids.empty() ? root_uid : uids.back(); }
};

class BlockManager {
 public:
  // hash_bits < 64 keeps only that many bits of each key: tests use it to force collisions.
  BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching, int32_t hash_bits = 64);

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return alloc_.num_blocks(); }
  int32_t num_free() const { return alloc_.num_free(); }
  int32_t num_used() const { return alloc_.num_used(); }
  int32_t num_cached_free() const { return num_cached_free_; }
  bool prefix_caching() const { return prefix_caching_; }
  const BlockAllocator& allocator() const { return alloc_; }

  // Longest run of cached full blocks matching tokens[0 : max_blocks * block_size]. Fills the
  // matched block ids and the chain; returns how many of the matched blocks are currently free
  // (they are taken out of the free pool when claimed).
  int32_t match_prefix(const int32_t* tokens, int32_t max_blocks, std::vector<int32_t>& blocks,
                       PrefixChain& chain) const;
  // Claims the blocks returned by match_prefix (one more owner each).
  void claim_cached(const std::vector<int32_t>& blocks);
  // A fresh block for new KV; evicts its cached content if it had any.
  int32_t allocate();
  // Claims a specific free block (COMPLETION engines receive prompt blocks from outside).
  void take(int32_t block_id);
  // Blocks after the chain's end (tokens[chain.size() * block_size ...], at most max_blocks in all)
  // whose keys are loadable from a lower tier, consecutive from the first: their count.
  int32_t match_loadable(const int32_t* tokens, int32_t max_blocks, const PrefixChain& chain) const;
  void add_loadable(const BlockKey& key) { loadable_.insert(key); }
  void drop_loadable(const BlockKey& key) { loadable_.erase(key); }
  size_t num_loadable() const { return loadable_.size(); }
  // Report the cached blocks that allocation evicts (take_evicted collects them).
  void set_report_evictions(bool on) { report_evictions_ = on; }
  std::vector<EvictedBlock> take_evicted();
  // Forgets the cached content of a block (e.g. a lower-tier load that failed verification): no later
  // request hits it; the block keeps its owners.
  void uncache(int32_t block_id);
  // Drops one owner of each block, last block first (so a sequence's tail is evicted before its
  // shared-looking prefix).
  void free_table(const std::vector<int32_t>& table);
  // Registers the full blocks table[chain.size() : num_full] (their tokens are final) in the
  // prefix cache and extends the chain. Content already cached in another block is not registered
  // twice; the chain then continues from that block's uid.
  void register_full_blocks(const int32_t* tokens, int32_t num_full, const std::vector<int32_t>& table,
                            PrefixChain& chain);

  int32_t ref_count(int32_t block_id) const { return alloc_.ref_count(block_id); }
  bool is_cached(int32_t block_id) const { return uid_[block_id] != 0; }
  std::vector<int32_t> free_list() const { return alloc_.free_list(); }
  // Throws std::logic_error describing the first inconsistency between the free list, the ref
  // counts and the prefix-cache index.
  void check_consistency() const;

 private:
  uint64_t hash_block(uint64_t parent_hash, const int32_t* tokens) const;
  uint64_t check_block(uint64_t parent_check, const int32_t* tokens) const;
  int32_t find(uint64_t hash, uint64_t parent_uid, const int32_t* tokens) const;
  void evict(int32_t block_id, bool report);

  int32_t block_size_;
  bool prefix_caching_;
  BlockAllocator alloc_;
  // Per block: registration uid (0 = not cached), its parent's uid, its hash and its token ids.
  std::vector<uint64_t> uid_, parent_uid_, hash_, check_;
  std::vector<int32_t> tokens_;  // num_blocks * block_size, valid where uid_ != 0
  std::unordered_multimap<uint64_t, int32_t> index_;
  uint64_t hash_mask_;
  uint64_t next_uid_ = 1;
  int32_t num_cached_free_ = 0;
  std::unordered_set<BlockKey, BlockKeyHash> loadable_;
  bool report_evictions_ = false;
  std::vector<EvictedBlock> evicted_;
};

}  // namespace deepinfer
