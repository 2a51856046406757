#include "deepinfer/block_allocator.hpp"

#include <stdexcept>
#include <string>

namespace deepinfer {

BlockAllocator::BlockAllocator(int32_t num_blocks) {
  if (num_blocks < 1) {
    throw std::invalid_argument("num_blocks must be >= 1, got " + std::to_string(num_blocks));
  }
  ref_counts_.assign(num_blocks, 0);
  for (int32_t i = 0; i < num_blocks; ++i) free_.push_back(i);
}

void BlockAllocator::check_id(int32_t block_id, const char* op) const {
  if (block_id < 0 || block_id >= num_blocks()) {
    throw std::out_of_range(std::string(op) + ": block_id must be in [0, " +
                            std::to_string(num_blocks()) + "), got " + std::to_string(block_id));
  }
}

int32_t BlockAllocator::allocate() {
  if (free_.empty()) throw std::runtime_error("allocate: no free KV blocks left");
  int32_t id = free_.front();
  free_.pop_front();
  ref_counts_[id] = 1;
  return id;
}

void BlockAllocator::incref(int32_t block_id) {
  check_id(block_id, "incref");
  if (ref_counts_[block_id] == 0) {
    throw std::logic_error("incref: block " + std::to_string(block_id) + " is free");
  }
  ++ref_counts_[block_id];
}

bool BlockAllocator::decref(int32_t block_id) {
  check_id(block_id, "decref");
  if (ref_counts_[block_id] == 0) {
    throw std::logic_error("decref: block " + std::to_string(block_id) + " is already free");
  }
  if (--ref_counts_[block_id] == 0) {
    free_.push_back(block_id);
    return true;
  }
  return false;
}

int32_t BlockAllocator::ref_count(int32_t block_id) const {
  check_id(block_id, "ref_count");
  return ref_counts_[block_id];
}

}  // namespace deepinfer
