#include "packer.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "prefix_tree.hpp"  // common_prefix
#include "radix.hpp"

namespace clawfast {

namespace {

// Which tree segment a merged node's tokens come from: tokens [off, off + len) of segment `seg`.
struct Ann {
    int32_t tree;
    int64_t seg;  // global segment index (seg_off[tree] + local index)
    int64_t off;
};

struct MNode : RadixNode {
    int64_t row0 = 0;      // first global row (forest DFS order)
    int64_t depth = 0;
    int64_t sub_end = 0;   // one past the last global row of its subtree
    std::vector<Ann> anns; // at most one per tree, in ascending tree order
};

// One placement unit: global rows [first, first + count) plus the ancestor path of `first`.
struct Item {
    int64_t first, count, cost;
};

// Stable counting sort of record indices by key in [0, n_keys): returns the CSR offsets and the order.
void bucket(const std::vector<int64_t>& key, int64_t n_keys, std::vector<int64_t>& off,
            std::vector<int64_t>& order) {
    off.assign(n_keys + 1, 0);
    for (int64_t k : key) ++off[k + 1];
    for (int64_t i = 0; i < n_keys; ++i) off[i + 1] += off[i];
    order.resize(key.size());
    std::vector<int64_t> fill(off.begin(), off.end() - 1);
    for (size_t i = 0; i < key.size(); ++i) order[fill[key[i]]++] = static_cast<int64_t>(i);
}

class Forest {
  public:
    explicit Forest(const PackInput& in) : in_(in) { nodes_.emplace_back(); }  // node 0: root

    PackOutput run() {
        merge();
        layout();
        index_targets();
        index_leaves();
        place();
        return emit();
    }

  private:
    // Kept set and DFS-first kept leaf of every segment: leaves are visited in DFS order and each
    // walk up stops at the first segment an earlier leaf already claimed (its ancestors are claimed).
    void merge() {
        const int64_t n_segs = in_.seg_off[in_.num_trees];
        first_leaf_.assign(n_segs, -1);
        mend_.assign(n_segs, -1);
        for (int32_t r = 0; r < in_.num_trees; ++r) {
            const int64_t s0 = in_.seg_off[r];
            for (int64_t l = in_.leaf_off[r]; l < in_.leaf_off[r + 1]; ++l) {
                if (!in_.leaf_kept[l]) continue;
                for (int64_t s = in_.leaf_node[l]; s >= 0 && first_leaf_[s0 + s] < 0; s = in_.seg_parent[s0 + s])
                    first_leaf_[s0 + s] = static_cast<int32_t>(l - in_.leaf_off[r]);
            }
            for (int64_t s = s0; s < in_.seg_off[r + 1]; ++s) {
                if (first_leaf_[s] < 0) continue;
                const int32_t p = in_.seg_parent[s];
                insert(r, s, p < 0 ? 0 : mend_[s0 + p]);
            }
        }
    }

    // Inserts tree segment s below the end of merged node `cur`, recording on every merged node it
    // covers which part of s it holds, and remembers the merged node where s ends.
    void insert(int32_t r, int64_t s, int32_t cur) {
        const int32_t* t = in_.tokens + in_.tok_off[r] + in_.seg_start[s];
        const int64_t len = in_.seg_len[s];
        int64_t i = 0;
        while (i < len) {
            int32_t ch = -1;
            for (int32_t c : nodes_[cur].children)
                if (nodes_[c].first == t[i]) { ch = c; break; }
            if (ch < 0) {
                MNode fresh;
                fresh.src = t + i;
                fresh.len = len - i;
                fresh.parent = cur;
                fresh.first = t[i];
                fresh.anns.push_back({r, s, i});
                nodes_.push_back(std::move(fresh));
                ch = static_cast<int32_t>(nodes_.size() - 1);
                nodes_[cur].children.push_back(ch);
                cur = ch;
                break;
            }
            const int64_t m = std::min(nodes_[ch].len, len - i);
            const int64_t k = common_prefix(nodes_[ch].src, t + i, m);
            if (k < nodes_[ch].len) ch = split(ch, k);
            nodes_[ch].anns.push_back({r, s, i});
            i += k;
            cur = ch;
        }
        mend_[s] = cur;
    }

    // Splits x after its first k tokens (`split_node`); both parts hold tokens of the same segments.
    // Row, depth and subtree fields are set later, by layout().
    int32_t split(int32_t x, int64_t k) {
        const int32_t h = split_node(nodes_, x, k);
        nodes_[h].anns = nodes_[x].anns;
        for (Ann& a : nodes_[x].anns) a.off += k;
        return h;
    }

    // Forest DFS order (children by ascending first token): global rows with token, depth and
    // parent; subtree ends per merged node.
    void layout() {
        std::vector<int32_t> stack;
        auto push_children = [&](int32_t x) {
            auto& ch = nodes_[x].children;
            std::sort(ch.begin(), ch.end(), [&](int32_t a, int32_t b) { return nodes_[a].first < nodes_[b].first; });
            for (auto it = ch.rbegin(); it != ch.rend(); ++it) stack.push_back(*it);
        };
        push_children(0);
        int64_t rows = 0;
        while (!stack.empty()) {
            const int32_t x = stack.back();
            stack.pop_back();
            MNode& node = nodes_[x];
            node.row0 = rows;
            node.depth = node.parent == 0 ? 0 : nodes_[node.parent].depth + nodes_[node.parent].len;
            rows += node.len;
            order_.push_back(x);
            push_children(x);
        }
        // Subtree ends, children before parents (reverse pre-order).
        for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
            MNode& node = nodes_[*it];
            node.sub_end = node.row0 + node.len;
            for (int32_t c : node.children) node.sub_end = std::max(node.sub_end, nodes_[c].sub_end);
        }
        g_token_.resize(rows);
        g_depth_.resize(rows);
        g_parent_.resize(rows);
        int64_t max_depth = 0;
        for (int32_t x : order_) {
            const MNode& node = nodes_[x];
            const int64_t parent_last = node.parent == 0 ? -1 : nodes_[node.parent].row0 + nodes_[node.parent].len - 1;
            for (int64_t j = 0; j < node.len; ++j) {
                const int64_t g = node.row0 + j;
                g_token_[g] = node.src[j];
                g_depth_[g] = static_cast<int32_t>(node.depth + j);
                g_parent_[g] = j == 0 ? parent_last : g - 1;
            }
            max_depth = std::max(max_depth, node.depth + node.len);
        }
        if (max_depth > in_.micro_batch_tokens)
            throw std::invalid_argument("a kept root-to-leaf path has " + std::to_string(max_depth) +
                                        " tokens, more than micro_batch_tokens=" +
                                        std::to_string(in_.micro_batch_tokens));
    }

    // Targets, bucketed by predicting row; within a row by target token (children are visited in
    // ascending first token) and then by tree (annotations are in tree order).
    void index_targets() {
        std::vector<int64_t> pred;
        for (int32_t x : order_) {
            const MNode& node = nodes_[x];
            const int64_t parent_last = node.parent == 0 ? -1 : nodes_[node.parent].row0 + nodes_[node.parent].len - 1;
            for (const Ann& a : node.anns) {
                if (!in_.seg_train[a.seg]) continue;
                const int64_t tok0 = in_.tok_off[a.tree] + in_.seg_start[a.seg] + a.off;
                // A token at depth 0 has no predecessor and so no target (never generated in a
                // real tree: prompts are non-empty).
                for (int64_t j = parent_last < 0 ? 1 : 0; j < node.len; ++j) {
                    pred.push_back(j == 0 ? parent_last : node.row0 + j - 1);
                    t_id_.push_back(node.src[j]);
                    t_tree_.push_back(a.tree);
                    t_leaf_.push_back(first_leaf_[a.seg]);
                    t_call_.push_back(in_.token_call[tok0 + j]);
                    t_lp_.push_back(in_.infer_logprobs[tok0 + j]);
                }
            }
        }
        bucket(pred, static_cast<int64_t>(g_token_.size()), t_off_, t_order_);
    }

    // Kept leaves, bucketed by their last row; within a row by tree, then leaf index.
    void index_leaves() {
        std::vector<int64_t> row;
        for (int32_t r = 0; r < in_.num_trees; ++r) {
            for (int64_t l = in_.leaf_off[r]; l < in_.leaf_off[r + 1]; ++l) {
                if (!in_.leaf_kept[l]) continue;
                const MNode& node = nodes_[mend_[in_.seg_off[r] + in_.leaf_node[l]]];
                row.push_back(node.row0 + node.len - 1);
                lf_tree_.push_back(r);
                lf_index_.push_back(static_cast<int32_t>(l - in_.leaf_off[r]));
            }
        }
        bucket(row, static_cast<int64_t>(g_token_.size()), lf_off_, lf_order_);
    }

    // Items: each root subtree that fits whole. A larger one is split greedily into pieces of
    // consecutive forest leaves (childless rows) in DFS order, a piece being the union of its
    // leaves' root-to-leaf paths: the next leaf joins while the union stays <= micro_batch_tokens.
    // In pre-order the union of the paths of consecutive leaves l_a..l_b is the ancestor path of the
    // row after l_{a-1} (context: real in an earlier piece) plus the run of rows up to l_b, so a
    // piece is an Item with cost depth(first) + count. A piece that starts at a leaf costs that
    // leaf's path length, which layout() checked is <= micro_batch_tokens.
    // Then first-fit-decreasing by cost (context + rows), ties in forest order.
    void place() {
        const int64_t T = in_.micro_batch_tokens;
        for (int32_t top : nodes_[0].children) {
            const int64_t a = nodes_[top].row0, end = nodes_[top].sub_end;
            if (end - a <= T) {
                items_.push_back({a, end - a, end - a});
                continue;
            }
            int64_t first = a, last = -1;  // the open piece: rows [first, last] + ancestors of first
            for (int64_t g = a; g < end; ++g) {
                if (g + 1 < end && g_parent_[g + 1] == g) continue;  // row g has a child: not a leaf
                if (last >= 0 && g_depth_[first] + (g - first + 1) > T) {
                    items_.push_back({first, last - first + 1, g_depth_[first] + (last - first + 1)});
                    first = last + 1;
                }
                last = g;
            }
            items_.push_back({first, end - first, g_depth_[first] + (end - first)});
        }
        std::sort(items_.begin(), items_.end(), [](const Item& x, const Item& y) { return x.first < y.first; });
        std::vector<int64_t> by_cost(items_.size());
        for (size_t i = 0; i < by_cost.size(); ++i) by_cost[i] = static_cast<int64_t>(i);
        std::stable_sort(by_cost.begin(), by_cost.end(),
                         [&](int64_t x, int64_t y) { return items_[x].cost > items_[y].cost; });
        std::vector<int64_t> used;
        for (int64_t it : by_cost) {
            size_t b = 0;
            while (b < used.size() && used[b] + items_[it].cost > T) ++b;
            if (b == used.size()) {
                used.push_back(0);
                batches_.emplace_back();
            }
            used[b] += items_[it].cost;
            batches_[b].push_back(it);
        }
    }

    PackOutput emit() {
        PackOutput out;
        out.row_off.push_back(0);
        out.tgt_off.push_back(0);
        out.leaf_off.push_back(0);
        int64_t n_rows = 0;
        for (const Item& item : items_) n_rows += item.cost;
        for (auto* v : {&out.input_ids, &out.position_ids, &out.kv_end, &out.parent_row}) v->reserve(n_rows);
        out.is_context.reserve(n_rows);
        for (auto* v : {&out.target_rows, &out.target_ids, &out.target_rollout, &out.target_leaf, &out.target_call})
            v->reserve(t_id_.size());
        out.infer_logprobs.reserve(t_id_.size());
        std::vector<int32_t> g2l(g_token_.size(), -1);
        std::vector<int64_t> rows;
        std::vector<uint8_t> ctx;
        for (auto& batch : batches_) {
            // Items in forest order: each adds the ancestors of its first row that the batch does
            // not hold yet (context), then its run. Two pieces of one root subtree may share a
            // batch; their common ancestors then appear once, real if they are real in either
            // piece (an earlier piece's run). The batch's rows are ancestor-closed, so the missing
            // ancestors of a first row lie after every row already placed: rows stay in DFS order.
            std::sort(batch.begin(), batch.end(), [&](int64_t x, int64_t y) { return items_[x].first < items_[y].first; });
            rows.clear();
            ctx.clear();
            for (int64_t it : batch) {
                const Item& item = items_[it];
                const size_t mark = rows.size();
                for (int64_t g = g_parent_[item.first]; g >= 0 && g2l[g] < 0; g = g_parent_[g]) rows.push_back(g);
                std::reverse(rows.begin() + mark, rows.end());
                ctx.resize(rows.size(), 1);
                for (int64_t g = item.first; g < item.first + item.count; ++g) rows.push_back(g);
                ctx.resize(rows.size(), 0);
                for (size_t i = mark; i < rows.size(); ++i) g2l[rows[i]] = static_cast<int32_t>(i);
            }
            for (size_t i = 0; i < rows.size(); ++i) {
                const int64_t g = rows[i];
                out.input_ids.push_back(g_token_[g]);
                out.position_ids.push_back(g_depth_[g]);
                out.parent_row.push_back(g_parent_[g] < 0 ? -1 : g2l[g_parent_[g]]);
                out.kv_end.push_back(static_cast<int32_t>(i));
                out.is_context.push_back(ctx[i]);
                if (ctx[i]) continue;
                for (int64_t k = t_off_[g]; k < t_off_[g + 1]; ++k) {
                    const int64_t t = t_order_[k];
                    out.target_rows.push_back(static_cast<int32_t>(i));
                    out.target_ids.push_back(t_id_[t]);
                    out.target_rollout.push_back(t_tree_[t]);
                    out.target_leaf.push_back(t_leaf_[t]);
                    out.target_call.push_back(t_call_[t]);
                    out.infer_logprobs.push_back(t_lp_[t]);
                }
                for (int64_t k = lf_off_[g]; k < lf_off_[g + 1]; ++k) {
                    const int64_t f = lf_order_[k];
                    out.leaf_rows.push_back(static_cast<int32_t>(i));
                    out.leaf_rollout.push_back(lf_tree_[f]);
                    out.leaf_index.push_back(lf_index_[f]);
                }
            }
            // kv_end: the last row of each subtree, children (later rows) pushing theirs up.
            const int64_t base = out.row_off.back();
            int32_t* kv = out.kv_end.data() + base;
            const int32_t* par = out.parent_row.data() + base;
            for (int64_t i = static_cast<int64_t>(rows.size()) - 1; i > 0; --i)
                if (par[i] >= 0) kv[par[i]] = std::max(kv[par[i]], kv[i]);
            for (int64_t g : rows) g2l[g] = -1;
            out.row_off.push_back(static_cast<int64_t>(out.input_ids.size()));
            out.tgt_off.push_back(static_cast<int64_t>(out.target_rows.size()));
            out.leaf_off.push_back(static_cast<int64_t>(out.leaf_rows.size()));
        }
        return out;
    }

    const PackInput& in_;
    std::vector<MNode> nodes_;
    std::vector<int32_t> order_;
    std::vector<int32_t> first_leaf_;  // per global segment: DFS-first kept leaf below, -1 if not kept
    std::vector<int32_t> mend_;        // per global segment: merged node where it ends
    std::vector<int32_t> g_token_, g_depth_;
    std::vector<int64_t> g_parent_;
    std::vector<int32_t> t_id_, t_tree_, t_leaf_, t_call_;
    std::vector<float> t_lp_;
    std::vector<int64_t> t_off_, t_order_;
    std::vector<int32_t> lf_tree_, lf_index_;
    std::vector<int64_t> lf_off_, lf_order_;
    std::vector<Item> items_;
    std::vector<std::vector<int64_t>> batches_;
};

}  // namespace

PackOutput pack_forest(const PackInput& in) { return Forest(in).run(); }

}  // namespace clawfast
