// A kernel operand that is one layer's array or a stack of them [L, ...] (a layer loop's
// weights or K/V pool), read at a layer index in place: handing the kernel a slice of the
// stack would make XLA copy it first (PERFORMANCE.md, "Against llama.cpp in its own
// formats"). Shared by the CPU kernels that take a layer operand.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jaxserve {

enum class StackError { kNone, kRank, kLayer };

// `dims` (an FFI buffer's dimensions) of one layer's array of `rank` dims, or of a stack
// [L, ...] of them: the layer's dims into inner[0 .. rank) and the element offset of
// `layer` into *offset. kRank when dims has neither rank, kLayer when layer is outside
// [0, L) (L = 1 for an unstacked array).
template <typename Dims>
inline StackError layer_of_stack(const Dims& dims, size_t rank, int64_t layer, int64_t* inner,
                                 int64_t* offset) {
  if (dims.size() != rank && dims.size() != rank + 1) return StackError::kRank;
  const size_t lead = dims.size() - rank;  // 1 for a stack
  int64_t elements = 1;
  for (size_t i = 0; i < rank; ++i) elements *= inner[i] = dims[lead + i];
  if (layer < 0 || layer >= (lead ? dims[0] : 1)) return StackError::kLayer;
  *offset = layer * elements;
  return StackError::kNone;
}

}  // namespace jaxserve
