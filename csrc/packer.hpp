// Packer: merges the kept sets of several prefix trees into one forest by token content and lays it
// out in micro-batches of at most micro_batch_tokens rows (the contract is docs/TREE.md).
//
// Pure C++17: spans in, vectors out, no Python headers. Inputs are trusted here (the binding layer
// validates them). A root-to-leaf path longer than micro_batch_tokens throws std::invalid_argument.
#pragma once

#include <cstdint>
#include <vector>

namespace clawfast {

// R trees, each given by its segment arrays (DFS pre-order: a parent precedes its children),
// concatenated. Tree r owns segments [seg_off[r], seg_off[r+1]), tokens [tok_off[r], tok_off[r+1])
// and leaves [leaf_off[r], leaf_off[r+1]); seg_parent, seg_start and leaf_node are local to the tree.
struct PackInput {
    int64_t num_trees = 0;
    const int64_t* seg_off = nullptr;
    const int32_t* seg_parent = nullptr;  // -1 for children of the root
    const int32_t* seg_start = nullptr;
    const int32_t* seg_len = nullptr;     // >= 1
    const uint8_t* seg_train = nullptr;   // generated and owned by a non-excluded call
    const int64_t* tok_off = nullptr;
    const int32_t* tokens = nullptr;
    const float* infer_logprobs = nullptr;
    const int32_t* token_call = nullptr;
    const int64_t* leaf_off = nullptr;
    const int32_t* leaf_node = nullptr;   // leaves in DFS order
    const uint8_t* leaf_kept = nullptr;
    int64_t micro_batch_tokens = 0;
};

// All micro-batches concatenated; batch b owns rows [row_off[b], row_off[b+1]), targets
// [tgt_off[b], tgt_off[b+1]) and leaves [leaf_off[b], leaf_off[b+1]). Row indices are batch-local.
struct PackOutput {
    std::vector<int64_t> row_off, tgt_off, leaf_off;
    std::vector<int32_t> input_ids, position_ids, kv_end, parent_row;
    std::vector<uint8_t> is_context;      // re-included ancestor rows of a split subtree
    std::vector<int32_t> target_rows, target_ids, target_rollout, target_leaf, target_call;
    std::vector<float> infer_logprobs;
    std::vector<int32_t> leaf_rows, leaf_rollout, leaf_index;
};

PackOutput pack_forest(const PackInput& in);

}  // namespace clawfast
