// What the two radix tries share: the prefix tree's trie of call paths (prefix_tree.cpp) and the
// packer's merged forest (packer.cpp). Each node type extends `RadixNode` with its own fields.
//
// Pure C++17, no Python headers.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace clawfast {

// A trie node: a run of len >= 1 tokens read in place from the caller's buffer, from `src` on.
struct RadixNode {
    const int32_t* src = nullptr;
    int64_t len = 0;
    int32_t parent = -1;
    int32_t first = -1;  // src[0], cached for child lookup
    std::vector<int32_t> children;
};

// Splits node x after its first k tokens (0 < k < len) and returns the new node's id. The new node
// takes the head and becomes x's parent; x keeps the tail, its children and its id, so every id
// recorded as "the node ending here" stays valid. The new node's own fields (those Node adds to
// RadixNode) are default-initialised: the caller sets them, and adjusts x's for the shorter run.
template <class Node>
int32_t split_node(std::vector<Node>& nodes, int32_t x, int64_t k) {
    Node head;
    head.src = nodes[x].src;
    head.len = k;
    head.parent = nodes[x].parent;
    head.first = nodes[x].first;
    head.children.push_back(x);
    nodes.push_back(std::move(head));
    const int32_t h = static_cast<int32_t>(nodes.size() - 1);
    for (int32_t& c : nodes[nodes[h].parent].children)
        if (c == x) c = h;
    Node& tail = nodes[x];
    tail.src += k;
    tail.len -= k;
    tail.parent = h;
    tail.first = tail.src[0];
    return h;
}

}  // namespace clawfast
