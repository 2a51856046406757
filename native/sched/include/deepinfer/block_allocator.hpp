// A fixed pool of KV-cache blocks with reference counts.
//
// This is the lowest layer of the block manager: it only knows which block ids are free and how
// many owners each used block has. Prefix hashing and per-sequence block tables sit above it.
//
// The free blocks form an intrusive doubly-linked list (two int arrays, no allocation per
// operation) so that a free block holding cached KV can be taken out of the middle of the list in
// O(1) when a prefix-cache hit revives it. Allocation pops the head; `decref` appends freed blocks
// at the tail (or the head when asked: blocks without reusable content should be recycled first,
// so that blocks with cached content stay available as long as possible: LRU eviction).
#pragma once

#include <cstdint>
#include <vector>

namespace deepinfer {

class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_blocks() - num_free_; }

  // Takes the block at the head of the free list (lowest id first after construction, then in
  // free order); its refcount becomes 1. Throws std::runtime_error when the pool is exhausted.
  int32_t allocate();
  // Takes a specific free block out of the free list (refcount becomes 1).
  void take(int32_t block_id);
  // Adds an owner to a used block (prefix sharing).
  void incref(int32_t block_id);
  // Drops one owner; returns true when the block became free. A freed block goes to the tail of the
  // free list (reused last) unless `to_head` is set (reused first).
  bool decref(int32_t block_id, bool to_head = false);
  int32_t ref_count(int32_t block_id) const;
  bool is_free(int32_t block_id) const { return ref_counts_[block_id] == 0; }
  // The block that the next `allocate()` returns (-1 when none is free).
  int32_t peek_head() const { return head_; }
  // Free block ids in allocation order (for tests and invariant checks).
  std::vector<int32_t> free_list() const;

 private:
  void check_id(int32_t block_id, const char* op) const;
  void unlink(int32_t block_id);
  void push_back(int32_t block_id);
  void push_front(int32_t block_id);

  std::vector<int32_t> ref_counts_;
  std::vector<int32_t> prev_, next_;  // free-list links, -1 = none
  int32_t head_ = -1, tail_ = -1, num_free_ = 0;
};

}  // namespace deepinfer
