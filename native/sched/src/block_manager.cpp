#include "deepinfer/block_manager.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace deepinfer {

namespace {

// splitmix64 finaliser: cheap and well mixed; collisions are harmless (hits are confirmed).
inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}
}  // namespace

uint64_t PrefixChain::last_hash() const { return hashes.empty() ? root_hash : hashes.back(); }

void PrefixChain::set_salt(uint64_t salt) {
  if (salt >> 63) throw std::invalid_argument("cache_salt must be < 2^63, got " + std::to_string(salt));
  root_uid = salt == 0 ? 0 : ((1ull << 63) | salt);
  root_hash = salt == 0 ? kPrefixRootHash : mix(kPrefixRootHash ^ mix(salt));
  root_check = salt == 0 ? kPrefixRootCheck : mix(kPrefixRootCheck + mix(salt ^ kPrefixRootHash));
}

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching, int32_t hash_bits)
    : block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      alloc_(num_blocks),
      hash_mask_(hash_bits >= 64 ? ~0ull : ((1ull << hash_bits) - 1)) {
  uid_.assign(num_blocks, 0);
  parent_uid_.assign(num_blocks, 0);
  hash_.assign(num_blocks, 0);
  check_.assign(num_blocks, 0);
  if (prefix_caching_) tokens_.assign(static_cast<size_t>(num_blocks) * block_size, 0);
}

uint64_t BlockManager::hash_block(uint64_t parent_hash, const int32_t* tokens) const {
  uint64_t h = mix(parent_hash);
  for (int32_t i = 0; i < block_size_; ++i) {
    h = mix(h ^ static_cast<uint32_t>(tokens[i]));
  }
  return h & hash_mask_;
}

uint64_t BlockManager::check_block(uint64_t parent_check, const int32_t* tokens) const {
  // Another chain over the same tokens (other constants, additive steps): with the hash, 128 bits
  // that name a prefix outside the device cache, where no block uid confirms a hit.
  uint64_t c = mix(parent_check + 0xA0761D6478BD642Full);
  for (int32_t i = 0; i < block_size_; ++i) {
    c = mix(c + 0xE7037ED1A0B428DBull * (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) + 1));
  }
  return c;
}

int32_t BlockManager::match_loadable(const int32_t* tokens, int32_t max_blocks, const PrefixChain& chain) const {
  if (!prefix_caching_ || loadable_.empty()) return 0;
  uint64_t h = chain.last_hash(), c = chain.last_check();
  int32_t n = 0;
  for (int32_t i = static_cast<int32_t>(chain.size()); i < max_blocks; ++i, ++n) {
    const int32_t* t = tokens + static_cast<size_t>(i) * block_size_;
    h = hash_block(h, t);
    c = check_block(c, t);
    if (!loadable_.count(BlockKey{h, c})) break;
  }
  return n;
}

std::vector<EvictedBlock> BlockManager::take_evicted() {
  std::vector<EvictedBlock> out;
  out.swap(evicted_);
  return out;
}

void BlockManager::uncache(int32_t block_id) {
  if (block_id < 0 || block_id >= num_blocks()) {
    throw std::out_of_range("uncache: block_id must be in [0, " + std::to_string(num_blocks()) + "), got " +
                            std::to_string(block_id));
  }
  if (uid_[block_id] == 0) return;
  if (alloc_.is_free(block_id)) --num_cached_free_;
  evict(block_id, /*report=*/false);
}

int32_t BlockManager::find(uint64_t hash, uint64_t parent_uid, const int32_t* tokens) const {
  auto range = index_.equal_range(hash);
  for (auto it = range.first; it != range.second; ++it) {
    int32_t b = it->second;
    if (parent_uid_[b] == parent_uid &&
        std::memcmp(&tokens_[static_cast<size_t>(b) * block_size_], tokens,
                    sizeof(int32_t) * block_size_) == 0) {
      return b;
    }
  }
  return -1;
}

int32_t BlockManager::match_prefix(const int32_t* tokens, int32_t max_blocks, std::vector<int32_t>& blocks,
                                   PrefixChain& chain) const {
  blocks.clear();
  chain.clear();
  if (!prefix_caching_) return 0;
  int32_t num_free_hits = 0;
  uint64_t h = chain.root_hash, parent = chain.root_uid;
  for (int32_t i = 0; i < max_blocks; ++i) {
    const int32_t* t = tokens + static_cast<size_t>(i) * block_size_;
    h = hash_block(h, t);
    int32_t b = find(h, parent, t);
    if (b < 0) break;
    blocks.push_back(b);
    chain.hashes.push_back(h);
    chain.checks.push_back(check_[b]);
    chain.uids.push_back(uid_[b]);
    parent = uid_[b];
    if (alloc_.is_free(b)) ++num_free_hits;
  }
  return num_free_hits;
}

void BlockManager::claim_cached(const std::vector<int32_t>& blocks) {
  for (int32_t b : blocks) {
    if (alloc_.is_free(b)) {
      alloc_.take(b);
      --num_cached_free_;
    } else {
      alloc_.incref(b);
    }
  }
}

void BlockManager::evict(int32_t b, bool report) {
  if (report && report_evictions_) {
    const int32_t* t = &tokens_[static_cast<size_t>(b) * block_size_];
    evicted_.push_back(EvictedBlock{b, BlockKey{hash_[b], check_[b]}, std::vector<int32_t>(t, t + block_size_)});
  }
  auto range = index_.equal_range(hash_[b]);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == b) {
      index_.erase(it);
      break;
    }
  }
  uid_[b] = 0;
  parent_uid_[b] = 0;
  hash_[b] = 0;
  check_[b] = 0;
}

int32_t BlockManager::allocate() {
  int32_t b = alloc_.allocate();
  if (uid_[b] != 0) {
    evict(b, /*report=*/true);
    --num_cached_free_;
  }
  return b;
}

void BlockManager::take(int32_t block_id) {
  alloc_.take(block_id);
  if (uid_[block_id] != 0) {
    // The caller brings the block's new content itself (a COMPLETION hand-off): the old content may
    // already be overwritten, so it is not reported for a lower tier.
    evict(block_id, /*report=*/false);
    --num_cached_free_;
  }
}

void BlockManager::free_table(const std::vector<int32_t>& table) {
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    bool cached = uid_[*it] != 0;
    if (alloc_.decref(*it, /*to_head=*/!cached) && cached) ++num_cached_free_;
  }
}

void BlockManager::register_full_blocks(const int32_t* tokens, int32_t num_full,
                                        const std::vector<int32_t>& table, PrefixChain& chain) {
  if (!prefix_caching_) return;
  for (int32_t i = static_cast<int32_t>(chain.size()); i < num_full; ++i) {
    const int32_t* t = tokens + static_cast<size_t>(i) * block_size_;
    uint64_t parent = chain.last_uid();
    uint64_t h = hash_block(chain.last_hash(), t);
    uint64_t c = check_block(chain.last_check(), t);
    int32_t b = table[i];
    int32_t existing = find(h, parent, t);
    if (existing >= 0) {
      // Same content is already cached (maybe in this very block): continue the chain from it.
      chain.hashes.push_back(h);
      chain.checks.push_back(c);
      chain.uids.push_back(uid_[existing]);
      continue;
    }
    if (uid_[b] != 0) {
      // The block is registered under other content; this cannot happen for a block owned by a
      // sequence that is still writing it, so it signals a bookkeeping bug.
      throw std::logic_error("register_full_blocks: block " + std::to_string(b) +
                             " is already cached with different content");
    }
    uid_[b] = next_uid_++;
    parent_uid_[b] = parent;
    hash_[b] = h;
    check_[b] = c;
    std::memcpy(&tokens_[static_cast<size_t>(b) * block_size_], t, sizeof(int32_t) * block_size_);
    index_.emplace(h, b);
    chain.hashes.push_back(h);
    chain.checks.push_back(c);
    chain.uids.push_back(uid_[b]);
  }
}

void BlockManager::check_consistency() const {
  std::vector<int32_t> free = alloc_.free_list();
  if (static_cast<int32_t>(free.size()) != alloc_.num_free()) {
    throw std::logic_error("free list length " + std::to_string(free.size()) + " != num_free " +
                           std::to_string(alloc_.num_free()));
  }
  std::vector<char> seen(num_blocks(), 0);
  int32_t cached_free = 0;
  for (int32_t b : free) {
    if (seen[b]) throw std::logic_error("block " + std::to_string(b) + " twice in the free list");
    seen[b] = 1;
    if (alloc_.ref_count(b) != 0) {
      throw std::logic_error("free block " + std::to_string(b) + " has a non-zero ref count");
    }
    if (uid_[b] != 0) ++cached_free;
  }
  for (int32_t b = 0; b < num_blocks(); ++b) {
    if (!seen[b] && alloc_.ref_count(b) <= 0) {
      throw std::logic_error("block " + std::to_string(b) + " is neither free nor owned");
    }
  }
  if (cached_free != num_cached_free_) {
    throw std::logic_error("cached free count " + std::to_string(num_cached_free_) + " != actual " +
                           std::to_string(cached_free));
  }
  size_t registered = 0;
  for (int32_t b = 0; b < num_blocks(); ++b) {
    if (uid_[b] == 0) continue;
    ++registered;
    bool indexed = false;
    auto range = index_.equal_range(hash_[b]);
    for (auto it = range.first; it != range.second; ++it) indexed |= it->second == b;
    if (!indexed) throw std::logic_error("cached block " + std::to_string(b) + " missing from the index");
  }
  if (registered != index_.size()) throw std::logic_error("prefix index holds stale entries");
}

}  // namespace deepinfer
