// Prefix tree of one rollout's model calls (the contract is docs/TREE.md).
//
// Pure C++17: spans in, vectors out, no Python headers. Inputs are trusted here (the binding layer
// validates them); the algorithm never reads outside the spans it is given.
#pragma once

#include <cstdint>
#include <vector>

namespace clawfast {

// Leaf statuses, in the order the Python façade names them.
enum LeafStatus : int8_t { kKept = 0, kDead = 1, kExcluded = 2 };

// One rollout's calls, already sorted by call index. Call c's path P(c) = prompt + output is
// ids[path_off[c] .. path_off[c+1]); its first prompt_len[c] tokens are the prompt. The output
// logprobs of all calls are concatenated in the same call order in `infer_logprobs`.
struct TreeInput {
    const int32_t* ids = nullptr;
    const int64_t* path_off = nullptr;   // n + 1, non-decreasing, path_off[0] == 0
    const int64_t* prompt_len = nullptr; // n, 1 <= prompt_len[c] <= path length
    const float* infer_logprobs = nullptr;     // sum of output lengths
    const int64_t* call_index = nullptr; // n, strictly increasing
    const uint8_t* excluded = nullptr;   // n, 1 if the call carries an excluded tag
    int64_t n = 0;
    bool drop_dead = true;
};

// Segment and token arrays in DFS pre-order (children by ascending first token), root excluded.
struct TreeOutput {
    std::vector<int32_t> seg_parent, seg_start, seg_len, seg_depth;
    std::vector<int8_t> seg_kind;        // 0 context, 1 generated
    std::vector<int32_t> tokens;
    std::vector<float> infer_logprobs;    // NaN for context
    std::vector<int32_t> token_call;     // owner call index, -1 for context
    std::vector<int32_t> end_node;       // per call (input order)
    std::vector<int32_t> leaf_node, leaf_depth;
    std::vector<int8_t> leaf_status;
    std::vector<int64_t> leaf_call_off;  // CSR: calls ending at leaf l are
    std::vector<int64_t> leaf_calls;     //   leaf_calls[leaf_call_off[l] .. leaf_call_off[l+1])
    int64_t num_unique_tokens = 0, num_flat_tokens = 0, num_call_tokens = 0;
};

// Builds the radix trie of all call paths with boundaries forced at branch points, prompt ends and
// output ends; assigns token kinds and owners; classifies leaves. Cost: one run comparison per
// input token (memcmp speed) plus O(nodes * log(children)) for the layout.
TreeOutput build_prefix_tree(const TreeInput& in);

// Length of the common prefix of a[0..n) and b[0..n). Equal runs are compared with memcmp.
int64_t common_prefix(const int32_t* a, const int32_t* b, int64_t n);

}  // namespace clawfast
