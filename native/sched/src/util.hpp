// Small helpers shared by the scheduler's translation units (not part of the public headers).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace deepinfer::detail {

inline std::string S(int64_t v) { return std::to_string(v); }

// Bad user input: surfaces in Python as ValueError.
[[noreturn]] inline void bad(const std::string& msg) { throw std::invalid_argument(msg); }

inline int32_t cdiv(int32_t a, int32_t b) { return (a + b - 1) / b; }

}  // namespace deepinfer::detail
