// A fixed pool of KV-cache blocks with reference counts.
//
// This is the lowest layer of the block manager: it only knows which block ids are free and how
// many owners each used block has. Prefix hashing and per-sequence block tables sit above it.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

namespace deepinfer {

class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_blocks() - num_free(); }

  // Takes a free block (lowest id first after construction, then in free order); refcount becomes 1.
  // Throws std::runtime_error when the pool is exhausted.
  int32_t allocate();
  // Adds an owner to a used block (prefix sharing).
  void incref(int32_t block_id);
  // Drops one owner; returns true when the block became free.
  bool decref(int32_t block_id);
  int32_t ref_count(int32_t block_id) const;

 private:
  void check_id(int32_t block_id, const char* op) const;

  std::vector<int32_t> ref_counts_;
  std::deque<int32_t> free_;
};

}  // namespace deepinfer
