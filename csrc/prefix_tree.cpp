#include "prefix_tree.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "radix.hpp"

namespace clawfast {

int64_t common_prefix(const int32_t* a, const int32_t* b, int64_t n) {
    // Consecutive prompts usually agree on their whole overlap: one memcmp settles that.
    if (n <= 0 || std::memcmp(a, b, static_cast<size_t>(n) * sizeof(int32_t)) == 0) return n < 0 ? 0 : n;
    constexpr int64_t kBlock = 64;
    int64_t i = 0;
    while (i + kBlock <= n && std::memcmp(a + i, b + i, kBlock * sizeof(int32_t)) == 0) i += kBlock;
    while (i < n && a[i] == b[i]) ++i;
    return i;
}

namespace {

// A trie node under construction: a run of tokens read from TreeInput::ids at `src`.
struct Node : RadixNode {
    int64_t depth = 0;  // tokens on the path before this node
    int32_t owner = -1; // position (in input order) of the call owning this node (`run`)
    int64_t lp_src = 0; // offset of the first token's logprob in TreeInput::infer_logprobs
};

class Builder {
  public:
    explicit Builder(const TreeInput& in) : in_(in) { nodes_.emplace_back(); }  // node 0: root

    // Walks/extends the trie along ids[base + d .. base + end) from node `cur` (at depth d), and
    // returns the node that ends exactly at depth `end` (splitting one if needed).
    int32_t descend(int32_t cur, int64_t base, int64_t d, int64_t end) {
        const int32_t* ids = in_.ids;
        while (d < end) {
            const int32_t tok = ids[base + d];
            int32_t ch = -1;
            for (int32_t c : nodes_[cur].children)
                if (nodes_[c].first == tok) { ch = c; break; }
            if (ch < 0) {
                Node fresh;
                fresh.src = ids + base + d;
                fresh.len = end - d;
                fresh.depth = d;
                fresh.parent = cur;
                fresh.first = tok;
                nodes_.push_back(std::move(fresh));
                const int32_t id = static_cast<int32_t>(nodes_.size() - 1);
                nodes_[cur].children.push_back(id);
                return id;
            }
            const int64_t m = std::min(nodes_[ch].len, end - d);
            const int64_t k = common_prefix(nodes_[ch].src, ids + base + d, m);
            if (k < nodes_[ch].len) ch = split(ch, k);
            cur = ch;
            d += k;
        }
        return cur;
    }

    // Splits node x after its first k tokens (`split_node`); owners are assigned after the trie is
    // complete, so only the depths need carrying over.
    int32_t split(int32_t x, int64_t k) {
        const int32_t h = split_node(nodes_, x, k);
        nodes_[h].depth = nodes_[x].depth;
        nodes_[x].depth += k;
        return h;
    }

    TreeOutput run() {
        const int64_t n = in_.n;
        std::vector<int32_t> prompt_node(n), end_node(n);
        std::vector<int64_t> lp_off(n);
        int64_t lp = 0;
        TreeOutput out;
        for (int64_t c = 0; c < n; ++c) {
            const int64_t base = in_.path_off[c];
            const int64_t L = in_.path_off[c + 1] - base;
            const int64_t pl = in_.prompt_len[c];
            prompt_node[c] = descend(0, base, 0, pl);
            end_node[c] = L > pl ? descend(prompt_node[c], base, pl, L) : prompt_node[c];
            lp_off[c] = lp;
            lp += L - pl;
            out.num_call_tokens += L;
        }

        // Kinds and owners. A generated node's owner is the call whose sample its kept path trains:
        // of the calls that generated it, a non-excluded one before an excluded one, and of those the
        // latest (a retry supersedes the call it retried, with which it shares the tokens both drew
        // alike; the earliest gave the retry's tokens the dead call's log-probs). Calls go in
        // ascending index, so a later call takes a node unless it is excluded and the owner is not.
        // The prompt-end boundary guarantees that nodes at depth >= prompt_len are all output.
        for (int64_t c = 0; c < n; ++c) {
            const int64_t pl = in_.prompt_len[c];
            for (int32_t x = end_node[c]; x != 0 && nodes_[x].depth >= pl; x = nodes_[x].parent) {
                const int32_t o = nodes_[x].owner;
                if (o < 0 || !in_.excluded[c] || in_.excluded[o]) {
                    nodes_[x].owner = static_cast<int32_t>(c);
                    nodes_[x].lp_src = lp_off[c] + (nodes_[x].depth - pl);
                }
            }
        }

        // A call is superseded if a later call sent exactly the same prompt; equal prompts end at
        // the same trie node (every prompt end is a node boundary).
        std::vector<uint8_t> retried(n, 0), seen(nodes_.size(), 0);
        for (int64_t c = n - 1; c >= 0; --c) {
            retried[c] = seen[prompt_node[c]];
            seen[prompt_node[c]] = 1;
        }
        int64_t last_main = -1;
        for (int64_t c = n - 1; c >= 0 && last_main < 0; --c)
            if (!in_.excluded[c]) last_main = c;

        layout(out);

        // Leaves. An end node of a non-excluded call (a main end) is a leaf iff no main end lies
        // strictly below it (excluded calls below, e.g. a compaction that extends the main path,
        // do not count), where a live main end (not dead, below) only counts live ones: a last
        // retry that answered a prefix of what it retried keeps its path. An end node of excluded
        // calls only is a leaf iff it has no child. Dead: a later call retried one of the calls
        // ending there, and the rollout's last main call does not end there.
        const size_t n_nodes = nodes_.size();
        std::vector<uint8_t> ends(n_nodes, 0), main_ends(n_nodes, 0), retried_at(n_nodes, 0), last_at(n_nodes, 0);
        for (int64_t c = 0; c < n; ++c) {
            ends[end_node[c]] = 1;
            if (!in_.excluded[c]) main_ends[end_node[c]] = 1;
            if (retried[c]) retried_at[end_node[c]] = 1;
            if (c == last_main) last_at[end_node[c]] = 1;
        }
        std::vector<uint8_t> dead(n_nodes, 0), main_below(n_nodes, 0), live_below(n_nodes, 0);
        for (size_t x = 0; x < n_nodes; ++x) dead[x] = in_.drop_dead && retried_at[x] && !last_at[x];
        for (auto it = order_.rbegin(); it != order_.rend(); ++it) {  // children before parents
            const int32_t p = nodes_[*it].parent;
            if (main_ends[*it] || main_below[*it]) main_below[p] = 1;
            if ((main_ends[*it] && !dead[*it]) || live_below[*it]) live_below[p] = 1;
        }
        std::vector<int32_t> leaf_of(n_nodes, -1);
        for (int32_t v = 0; v < static_cast<int32_t>(order_.size()); ++v) {
            const int32_t x = order_[v];
            const bool leaf = main_ends[x] ? !(dead[x] ? main_below[x] : live_below[x])
                                           : ends[x] && nodes_[x].children.empty();
            if (leaf) {
                leaf_of[x] = static_cast<int32_t>(out.leaf_node.size());
                out.leaf_node.push_back(v);
                out.leaf_depth.push_back(static_cast<int32_t>(nodes_[x].depth + nodes_[x].len));
            }
        }
        const size_t n_leaves = out.leaf_node.size();
        out.leaf_call_off.assign(n_leaves + 1, 0);
        for (int64_t c = 0; c < n; ++c)
            if (leaf_of[end_node[c]] >= 0) ++out.leaf_call_off[leaf_of[end_node[c]] + 1];
        for (size_t l = 0; l < n_leaves; ++l) out.leaf_call_off[l + 1] += out.leaf_call_off[l];
        out.leaf_calls.resize(out.leaf_call_off[n_leaves]);
        std::vector<int64_t> fill(out.leaf_call_off.begin(), out.leaf_call_off.end() - 1);
        std::vector<int64_t> leaf_call_pos(out.leaf_calls.size());
        for (int64_t c = 0; c < n; ++c) {
            const int32_t l = leaf_of[end_node[c]];
            if (l >= 0) {
                leaf_call_pos[fill[l]] = c;
                out.leaf_calls[fill[l]++] = in_.call_index[c];
            }
        }
        out.leaf_status.resize(n_leaves);
        for (size_t l = 0; l < n_leaves; ++l) {
            bool all_excluded = true;
            for (int64_t i = out.leaf_call_off[l]; i < out.leaf_call_off[l + 1]; ++i)
                all_excluded = all_excluded && in_.excluded[leaf_call_pos[i]];
            if (all_excluded)
                out.leaf_status[l] = kExcluded;
            else if (dead[order_[out.leaf_node[l]]])
                out.leaf_status[l] = kDead;
            else
                out.leaf_status[l] = kKept;
            if (out.leaf_status[l] == kKept) out.num_flat_tokens += out.leaf_depth[l];
        }

        out.end_node.resize(n);
        for (int64_t c = 0; c < n; ++c) out.end_node[c] = dfs_id_[end_node[c]];
        return out;
    }

  private:
    // DFS pre-order layout of the segment and token arrays (root excluded).
    void layout(TreeOutput& out) {
        const size_t n_nodes = nodes_.size();
        dfs_id_.assign(n_nodes, -1);
        order_.clear();
        order_.reserve(n_nodes - 1);
        std::vector<int32_t> stack;
        auto push_children = [&](int32_t x) {
            auto& ch = nodes_[x].children;
            std::sort(ch.begin(), ch.end(),
                      [&](int32_t a, int32_t b) { return nodes_[a].first < nodes_[b].first; });
            for (auto it = ch.rbegin(); it != ch.rend(); ++it) stack.push_back(*it);
        };
        push_children(0);
        while (!stack.empty()) {
            const int32_t x = stack.back();
            stack.pop_back();
            dfs_id_[x] = static_cast<int32_t>(order_.size());
            order_.push_back(x);
            push_children(x);
        }
        const size_t n_segs = order_.size();
        int64_t total = 0;
        for (int32_t x : order_) total += nodes_[x].len;
        out.num_unique_tokens = total;
        out.seg_parent.resize(n_segs);
        out.seg_start.resize(n_segs);
        out.seg_len.resize(n_segs);
        out.seg_depth.resize(n_segs);
        out.seg_kind.resize(n_segs);
        out.tokens.resize(total);
        out.infer_logprobs.resize(total);
        out.token_call.resize(total);
        const float nan = std::numeric_limits<float>::quiet_NaN();
        int64_t pos = 0;
        for (size_t v = 0; v < n_segs; ++v) {
            const Node& x = nodes_[order_[v]];
            out.seg_parent[v] = x.parent == 0 ? -1 : dfs_id_[x.parent];
            out.seg_start[v] = static_cast<int32_t>(pos);
            out.seg_len[v] = static_cast<int32_t>(x.len);
            out.seg_depth[v] = static_cast<int32_t>(x.depth);
            out.seg_kind[v] = x.owner >= 0 ? 1 : 0;
            std::memcpy(out.tokens.data() + pos, x.src, x.len * sizeof(int32_t));
            if (x.owner >= 0) {
                std::memcpy(out.infer_logprobs.data() + pos, in_.infer_logprobs + x.lp_src, x.len * sizeof(float));
                std::fill_n(out.token_call.data() + pos, x.len, static_cast<int32_t>(in_.call_index[x.owner]));
            } else {
                std::fill_n(out.infer_logprobs.data() + pos, x.len, nan);
                std::fill_n(out.token_call.data() + pos, x.len, -1);
            }
            pos += x.len;
        }
    }

    const TreeInput& in_;
    std::vector<Node> nodes_;
    std::vector<int32_t> dfs_id_;  // node id -> DFS index
    std::vector<int32_t> order_;   // DFS index -> node id
};

}  // namespace

TreeOutput build_prefix_tree(const TreeInput& in) { return Builder(in).run(); }

}  // namespace clawfast
