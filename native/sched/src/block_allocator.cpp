#include "deepinfer/block_allocator.hpp"

#include <stdexcept>
#include <string>

namespace deepinfer {

BlockAllocator::BlockAllocator(int32_t num_blocks) {
  if (num_blocks < 1) {
    throw std::invalid_argument("num_blocks must be >= 1, got " + std::to_string(num_blocks));
  }
  ref_counts_.assign(num_blocks, 0);
  prev_.assign(num_blocks, -1);
  next_.assign(num_blocks, -1);
  for (int32_t i = 0; i < num_blocks; ++i) push_back(i);
}

void BlockAllocator::check_id(int32_t block_id, const char* op) const {
  if (block_id < 0 || block_id >= num_blocks()) {
    throw std::out_of_range(std::string(op) + ": block_id must be in [0, " +
                            std::to_string(num_blocks()) + "), got " + std::to_string(block_id));
  }
}

void BlockAllocator::unlink(int32_t b) {
  int32_t p = prev_[b], n = next_[b];
  (p >= 0 ? next_[p] : head_) = n;
  (n >= 0 ? prev_[n] : tail_) = p;
  prev_[b] = next_[b] = -1;
  --num_free_;
}

void BlockAllocator::push_back(int32_t b) {
  prev_[b] = tail_;
  next_[b] = -1;
  (tail_ >= 0 ? next_[tail_] : head_) = b;
  tail_ = b;
  ++num_free_;
}

void BlockAllocator::push_front(int32_t b) {
  next_[b] = head_;
  prev_[b] = -1;
  (head_ >= 0 ? prev_[head_] : tail_) = b;
  head_ = b;
  ++num_free_;
}

int32_t BlockAllocator::allocate() {
  if (head_ < 0) throw std::runtime_error("allocate: no free KV blocks left");
  int32_t id = head_;
  unlink(id);
  ref_counts_[id] = 1;
  return id;
}

void BlockAllocator::take(int32_t block_id) {
  check_id(block_id, "take");
  if (ref_counts_[block_id] != 0) {
    throw std::logic_error("take: block " + std::to_string(block_id) + " is in use");
  }
  unlink(block_id);
  ref_counts_[block_id] = 1;
}

void BlockAllocator::incref(int32_t block_id) {
  check_id(block_id, "incref");
  if (ref_counts_[block_id] == 0) {
    throw std::logic_error("incref: block " + std::to_string(block_id) + " is free");
  }
  ++ref_counts_[block_id];
}

bool BlockAllocator::decref(int32_t block_id, bool to_head) {
  check_id(block_id, "decref");
  if (ref_counts_[block_id] == 0) {
    throw std::logic_error("decref: block " + std::to_string(block_id) + " is already free");
  }
  if (--ref_counts_[block_id] == 0) {
    if (to_head) {
      push_front(block_id);
    } else {
      push_back(block_id);
    }
    return true;
  }
  return false;
}

int32_t BlockAllocator::ref_count(int32_t block_id) const {
  check_id(block_id, "ref_count");
  return ref_counts_[block_id];
}

std::vector<int32_t> BlockAllocator::free_list() const {
  std::vector<int32_t> out;
  out.reserve(num_free_);
  for (int32_t b = head_; b >= 0; b = next_[b]) out.push_back(b);
  return out;
}

}  // namespace deepinfer
