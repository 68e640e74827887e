// Ring attention (Note [Ring attention]) and all-to-all attention (Note
// [All-to-all attention]) against attention over the whole sequence in one
// process: outputs and the gradients of q, k and v, for every
// context-parallel group size the world allows, the zigzag and contiguous
// splits, causal or not, grouped-query and multi-head, fp32 and bf16, packed
// rows (documents side by side); and the causal work per rank under each split.
#include "meshtrain/parallel/ring_attention.h"
#include "meshtrain/parallel/ulysses_attention.h"
#include "tests/harness/mpi_env.h"
#include "tests/harness/same_values.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace meshtrain::parallel {
namespace {

using testing::world;
using CommPtr = std::shared_ptr<comm::Communicator>;

std::vector<int> cp_sizes() {
  std::vector<int> out;
  for (int cp : {1, 2, 3, 4, 8})
    if (world()->size() % cp == 0) out.push_back(cp);
  return out;
}

using testing::same;

// softmax(QKᵀ·scale, causal, window, soft-cap)·V over the whole sequence, k and v repeated per query group;
// `starts` (if defined, [B, T]): each row's document start, a query sees its own document only.
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const model::AttentionSpec& rule,
                     const at::Tensor& starts = {}) {
  const int64_t group = q.size(1) / k.size(1), t = q.size(2);
  const at::Tensor kk = k.repeat_interleave(group, 1), vv = v.repeat_interleave(group, 1);
  at::Tensor s = at::matmul(q, kk.transpose(-2, -1)) * rule.scale;
  if (rule.softcap > 0) s = at::tanh(s / rule.softcap) * rule.softcap;
  if (rule.causal) {
    at::Tensor hidden = at::ones({t, t}, at::kBool).triu(1);
    if (rule.window > 0) hidden = hidden.logical_or(at::ones({t, t}, at::kBool).tril(-rule.window));
    s = s.masked_fill(hidden, -std::numeric_limits<float>::infinity());
  }
  if (starts.defined()) {
    const at::Tensor other = (starts.unsqueeze(2) != starts.unsqueeze(1)).unsqueeze(1);
    s = s.masked_fill(other, -std::numeric_limits<float>::infinity());
  }
  return at::matmul(at::softmax(s, -1), vv);
}

// Documents of 1 to 2·t/3 rows side by side, different in every batch row: [b, t], each row's document start.
at::Tensor document_starts(int64_t b, int64_t t) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor starts = at::zeros({b, t}, at::kLong);
  for (int64_t row = 0; row < b; ++row) {
    for (int64_t begin = 0; begin < t;) {
      const int64_t length = 1 + at::randint(0, std::max<int64_t>(1, 2 * t / 3), {1}, g, at::kLong).item<int64_t>();
      starts[row].narrow(0, begin, std::min(length, t - begin)).fill_(begin);
      begin += length;
    }
  }
  return starts;
}

double relative(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() /
         std::max(1e-12, want.to(at::kDouble).abs().max().item<double>());
}

struct Case {
  int64_t heads, kv_heads;
  bool causal, zigzag;
  at::ScalarType dtype;
  int64_t window = 0;
  double softcap = 0;
  bool packed = false;  // documents side by side in each row
  int64_t stride = 1;   // positions passed as stride × the row's (gaps: all-to-all's explicit path)
};

using Attention = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const CommPtr&, const model::AttentionSpec&, const at::Tensor&)>;

// `rows`: per rank (beyond 1024 the ring's products run in tiles of 512).
void check(const CommPtr& comm, const Case& c, const std::string& what, Attention attention = ring_attention,
           int64_t rows = 8) {
  const int cp = comm->size(), r = comm->rank();
  const int64_t b = rows > 8 ? 1 : 2, t = rows * cp, d = 8;
  const model::AttentionSpec rule{1.0 / std::sqrt(static_cast<double>(d)), c.causal, c.window, c.softcap};
  const at::Tensor q = same({b, c.heads, t, d}, 1).to(c.dtype), k = same({b, c.kv_heads, t, d}, 2).to(c.dtype),
                   v = same({b, c.kv_heads, t, d}, 3).to(c.dtype), w = same({b, c.heads, t, d}, 4);
  // The oracle: the whole sequence, in fp32.
  const at::Tensor qf = q.to(at::kFloat).clone().requires_grad_(), kf = k.to(at::kFloat).clone().requires_grad_(),
                   vf = v.to(at::kFloat).clone().requires_grad_();
  const at::Tensor starts = c.packed ? document_starts(b, t) : at::Tensor();
  const at::Tensor want = reference(qf, kf, vf, rule, starts);
  (want * w).sum().backward();
  // This rank's rows, through the ring.
  const at::Tensor pos = c.zigzag ? zigzag_positions(t, cp, r) : contiguous_positions(t, cp, r);
  const at::Tensor ql = q.index_select(2, pos).requires_grad_(), kl = k.index_select(2, pos).requires_grad_(),
                   vl = v.index_select(2, pos).requires_grad_();
  const at::Tensor got =
      attention(ql, kl, vl, pos * c.stride, comm, rule, c.packed ? starts.index_select(1, pos) : at::Tensor());
  EXPECT_EQ(got.scalar_type(), c.dtype) << what;
  (got.to(at::kFloat) * w.index_select(2, pos)).sum().backward();
  const double tol = c.dtype == at::kFloat ? 1e-5 : 2e-2;
  EXPECT_LE(relative(got, want.index_select(2, pos)), tol) << "output, " << what;
  EXPECT_LE(relative(ql.grad(), qf.grad().index_select(2, pos)), tol) << "dq, " << what;
  EXPECT_LE(relative(kl.grad(), kf.grad().index_select(2, pos)), tol) << "dk, " << what;
  EXPECT_LE(relative(vl.grad(), vf.grad().index_select(2, pos)), tol) << "dv, " << what;
}

TEST(RingAttention, EqualsWholeSequenceAttention) {
  for (int cp : cp_sizes()) {
    const CommPtr comm = world()->split(world()->rank() / cp, world()->rank(), "test:cp" + std::to_string(cp));
    for (const Case& c : {Case{4, 2, true, true, at::kFloat}, Case{4, 4, true, true, at::kFloat},
                          Case{4, 2, false, true, at::kFloat}, Case{4, 1, true, false, at::kFloat},
                          Case{4, 2, true, true, at::kBFloat16}, Case{4, 2, true, true, at::kFloat, 5, 0},
                          Case{4, 2, true, false, at::kFloat, 11, 2.0}, Case{4, 4, false, true, at::kFloat, 0, 1.5},
                          Case{4, 2, true, true, at::kFloat, 0, 0, true}, Case{4, 1, true, false, at::kFloat, 6, 2.0, true}}) {
      check(comm, c, "cp " + std::to_string(cp) + ", heads " + std::to_string(c.heads) + "/" +
                         std::to_string(c.kv_heads) + (c.causal ? ", causal" : "") +
                         (c.zigzag ? ", zigzag" : ", contiguous") + (c.dtype == at::kBFloat16 ? ", bf16" : "") +
                         (c.window ? ", window " + std::to_string(c.window) : "") +
                         (c.softcap > 0 ? ", soft-cap" : "") + (c.packed ? ", packed" : ""));
    }
  }
}

TEST(AllToAllAttention, EqualsWholeSequenceAttention) {
  for (int cp : cp_sizes()) {
    const CommPtr comm = world()->split(world()->rank() / cp, world()->rank(), "test:cp" + std::to_string(cp));
    const int64_t heads = cp == 3 ? 6 : 8;
    for (const Case& c : {Case{heads, heads, true, true, at::kFloat}, Case{2 * heads, heads, true, false, at::kFloat},
                          Case{heads, heads, false, true, at::kFloat}, Case{heads, heads, true, true, at::kBFloat16},
                          Case{heads, heads, true, true, at::kFloat, 5, 2.0}, Case{heads, heads, true, true, at::kFloat, 0, 0, true},
                          Case{heads, heads, true, true, at::kFloat, 0, 0, true, 2},
                          Case{2 * heads, heads, true, true, at::kFloat, 0, 0, true, 2}}) {
      check(comm, c, "all-to-all, cp " + std::to_string(cp) + ", heads " + std::to_string(c.heads) + "/" +
                         std::to_string(c.kv_heads) + (c.window ? ", window and soft-cap" : "") +
                         (c.packed ? ", packed" : "") + (c.stride > 1 ? ", positions with gaps" : ""),
                     all_to_all_attention);
    }
    if (cp == 3) {  // 4 heads do not split 3 ways
      const at::Tensor x = same({1, 4, 6, 8}, 5);
      try {
        all_to_all_attention(x, x, x, zigzag_positions(18, 3, comm->rank()).narrow(0, 0, 6), comm, {1.0, true});
        ADD_FAILURE() << "4 heads split over cp 3";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("multiples of cp = 3"), std::string::npos) << e.what();
      }
    }
  }
}

// 1,280 rows per rank: each half cut into tiles of 512 and 128; a window longer than a tile.
TEST(RingAttention, LongRowsInTilesEqualWholeSequenceAttention) {
  if (world()->size() % 2 != 0) GTEST_SKIP() << "run at an even rank count";
  const CommPtr comm = world()->split(world()->rank() / 2, world()->rank(), "test:tiles");
  for (const Case& c : {Case{2, 1, true, true, at::kFloat, 700, 2.0}, Case{2, 2, true, false, at::kFloat},
                        Case{2, 1, true, true, at::kFloat, 0, 0, true}}) {
    check(comm, c, std::string("1280 rows per rank, ") + (c.zigzag ? "zigzag" : "contiguous") +
                       (c.window ? ", window 700, soft-cap" : "") + (c.packed ? ", packed" : ""),
          ring_attention, 1280);
  }
}

TEST(HybridAttention, EqualsWholeSequenceAttention) {
  for (int cp : {4, 8}) {
    if (world()->size() % cp != 0) continue;
    const CommPtr comm = world()->split(world()->rank() / cp, world()->rank(), "test:hybrid" + std::to_string(cp));
    for (int a2a = 2; a2a < cp; a2a *= 2) {
      const int r = comm->rank();
      const CommPtr group = comm->split(r / a2a, r, "test:a2a"), ring = comm->split(r % a2a, r, "test:ring");
      auto hybrid = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                        const CommPtr&, const model::AttentionSpec& rule, const at::Tensor& documents) {
        return hybrid_attention(q, k, v, pos, group, ring, rule, documents);
      };
      for (const Case& c : {Case{8, 8, true, true, at::kFloat}, Case{8, 4, true, true, at::kFloat, 7, 2.0},
                            Case{4, 2, true, false, at::kFloat}, Case{8, 4, true, true, at::kBFloat16},
                            Case{8, 4, true, true, at::kFloat, 0, 0, true}}) {
        if (c.heads % a2a != 0 || c.kv_heads % a2a != 0) continue;  // heads split over the all-to-all group
        check(comm, c, "hybrid, cp " + std::to_string(cp) + " as " + std::to_string(a2a) + " all-to-all x " +
                           std::to_string(cp / a2a) + " ring, heads " + std::to_string(c.heads) + "/" +
                           std::to_string(c.kv_heads) + (c.window ? ", window and soft-cap" : "") +
                           (c.packed ? ", packed" : ""), hybrid);
      }
    }
  }
}

// Every rank of the zigzag split computes the same number of causal (query,
// key) pairs; the contiguous split gives the last rank 2cp − 1 times the first's.
TEST(RingAttention, ZigzagBalancesCausalWork) {
  for (int cp : {2, 3, 4, 8}) {
    const int64_t t = 1024 * cp;
    std::vector<int64_t> zigzag, contiguous;
    for (int r = 0; r < cp; ++r) {
      zigzag.push_back(attention_pairs(zigzag_positions(t, cp, r), t, true));
      contiguous.push_back(attention_pairs(contiguous_positions(t, cp, r), t, true));
    }
    auto spread = [](const std::vector<int64_t>& x) {
      return static_cast<double>(*std::max_element(x.begin(), x.end())) / *std::min_element(x.begin(), x.end());
    };
    EXPECT_LE(spread(zigzag), 1.0 + 1e-12) << "cp " << cp;
    EXPECT_GT(spread(contiguous), 2.0 * cp - 1.5) << "cp " << cp;
    int64_t total = 0;
    for (int64_t z : zigzag) total += z;
    EXPECT_EQ(total, t * (t + 1) / 2) << "every causal pair once, cp " << cp;
  }
}

// The same, measured: the scores the ring computes on each rank (products of
// fully hidden position runs skipped) are equal under the zigzag split; under
// the contiguous one the last rank computes (4cp − 1)/3 times the first's
// (its 2 half-chunks see 4cp − 1 half-chunks, rank 0's see 3).
TEST(RingAttention, ZigzagBalancesTheScoresComputed) {
  const int cp = world()->size();
  if (cp < 2) GTEST_SKIP() << "needs 2 ranks or more";
  const int64_t t = 16 * cp;
  for (bool zigzag : {true, false}) {
    const at::Tensor pos = zigzag ? zigzag_positions(t, cp, world()->rank()) : contiguous_positions(t, cp, world()->rank());
    const at::Tensor q = same({1, 2, t, 4}, 1).index_select(2, pos).requires_grad_();
    const at::Tensor kv = same({1, 1, t, 4}, 2).index_select(2, pos).requires_grad_();
    RingProfile profile;
    {
      RingProfileScope scope(profile);
      ring_attention(q, kv, kv, pos, world(), {0.5, true}).sum().backward();
    }
    at::Tensor all = at::empty({cp}, at::kDouble);
    world()->all_gather(all, at::tensor({static_cast<double>(profile.scores)}, at::kDouble)).wait();
    const double spread = (all.max() / all.min()).item<double>();
    if (zigzag) EXPECT_EQ(spread, 1.0) << all;
    else EXPECT_NEAR(spread, (4.0 * cp - 1) / 3, 1e-9) << all;
    EXPECT_EQ(profile.overlapped_hops, 2 * (cp - 1));
  }
}

// Packed rows: tiles whose rows share no document are skipped, so documents
// of a quarter of the sequence cost fewer scores than one document per row.
TEST(RingAttention, PackedRowsSkipTilesOfOtherDocuments) {
  const int cp = world()->size();
  if (cp < 2) GTEST_SKIP() << "needs 2 ranks or more";
  const int64_t t = 64 * cp;
  const at::Tensor pos = zigzag_positions(t, cp, world()->rank());
  const at::Tensor q = same({1, 2, t, 4}, 1).index_select(2, pos), kv = same({1, 1, t, 4}, 2).index_select(2, pos);
  const at::Tensor starts = at::arange(t, at::kLong).div(t / 4, "floor").mul(t / 4).unsqueeze(0);  // 4 documents
  int64_t scores[2] = {0, 0};
  for (bool packed : {false, true}) {
    RingProfile profile;
    {
      RingProfileScope scope(profile);
      ring_attention(q, kv, kv, pos, world(), {0.5, true}, packed ? starts.index_select(1, pos) : at::Tensor());
    }
    scores[packed] = profile.scores;
  }
  // Causal over T² / 2 against 4 documents' 4 · (T/4)² / 2 = T² / 8, in tiles of T / 4cp rows.
  EXPECT_LT(scores[1], scores[0] * 0.6) << "packed " << scores[1] << ", one document " << scores[0];
}

TEST(RingAttention, UnevenSplitsAreRefusedWithTheFormula) {
  try {
    zigzag_positions(100, 3, 0);
    ADD_FAILURE() << "100 rows split into 6 chunks";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 2 x cp = 6"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshtrain::parallel
