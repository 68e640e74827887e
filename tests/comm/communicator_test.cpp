// Every collective and dtype against values computed by hand, on however many
// ranks mpirun started (CTest runs 1, 2, 3, 4 and 8).
#include "meshtrain/comm/communicator.h"
#include "tests/harness/mpi_env.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>

namespace meshtrain::comm {
namespace {

using testing::world;

// Exact comparison: every value below is a small integer or half-integer, which
// all six dtypes (bfloat16 included) represent exactly, and sums stay below 256.
void expect_same(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_EQ(got.sizes(), want.sizes());
  ASSERT_EQ(got.scalar_type(), want.scalar_type());
  EXPECT_TRUE(at::equal(got, want)) << "got\n" << got << "\nwant\n" << want;
}

class CollectiveTest : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  at::TensorOptions opts() const { return at::TensorOptions().dtype(GetParam()); }
  Communicator& c() const { return *world(); }
  int n() const { return world()->size(); }
  int rank() const { return world()->rank(); }
  // v(r, i) = (r + 1) + i % 5
  at::Tensor rank_values(int r, int64_t numel) const {
    return (at::arange(numel, at::kLong).remainder(5) + (r + 1)).to(GetParam());
  }
};

INSTANTIATE_TEST_SUITE_P(Dtypes, CollectiveTest,
                         ::testing::Values(at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong),
                         [](const auto& info) { return dtype_name(info.param); });

TEST_P(CollectiveTest, AllReduceSumMaxMinAvg) {
  for (int64_t numel : {0, 1, 7, 1031}) {
    const at::Tensor base = at::arange(numel, at::kLong).remainder(5);
    const int64_t n = this->n();
    at::Tensor sum = rank_values(rank(), numel), mx = sum.clone(), mn = sum.clone(), avg = sum.clone();
    std::vector<Work> works{c().all_reduce(sum), c().all_reduce(mx, ReduceOp::kMax),
                            c().all_reduce(mn, ReduceOp::kMin), c().all_reduce(avg, ReduceOp::kAvg)};
    wait_all(works);
    expect_same(sum, (base * n + n * (n + 1) / 2).to(GetParam()));
    expect_same(mx, (base + n).to(GetParam()));
    expect_same(mn, (base + 1).to(GetParam()));
    // avg = sum / n = (n + 1) / 2 + base: exact for floats, truncated for integers
    if (at::isFloatingType(GetParam())) expect_same(avg, (base.to(at::kDouble) + (n + 1) / 2.0).to(GetParam()));
    else expect_same(avg, (base * n + n * (n + 1) / 2).div(n, "trunc").to(GetParam()));
  }
}

TEST_P(CollectiveTest, ReduceScatterEven) {
  const int64_t k = 3;
  // in[j, :] = j + rank  ->  rank r's rows j of [r*k, r*k+k) hold n*j + n(n-1)/2
  at::Tensor in = (at::arange(n() * k, at::kLong) + rank()).unsqueeze(1).repeat({1, 2}).to(GetParam());
  at::Tensor out = at::empty({k, 2}, opts());
  c().reduce_scatter(out, in).wait();
  at::Tensor rows = at::arange(rank() * k, rank() * k + k, at::kLong);
  expect_same(out, (rows * n() + n() * (n() - 1) / 2).unsqueeze(1).repeat({1, 2}).to(GetParam()));
}

TEST_P(CollectiveTest, ReduceScatterUnevenCounts) {
  // 2n+1 rows do not divide by n (n > 1); and a split giving everything to the last rank.
  for (const auto& counts : {even_counts(2 * n() + 1, n()), [&] {
                               std::vector<int64_t> v(n(), 0);
                               v.back() = 5;
                               return v;
                             }()}) {
    const int64_t rows = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    at::Tensor in = (at::arange(rows, at::kLong) + rank()).unsqueeze(1).repeat({1, 3}).to(GetParam());
    at::Tensor out = at::empty({counts[rank()], 3}, opts());
    at::Tensor out_max = at::empty({counts[rank()], 3}, opts());
    wait_all({c().reduce_scatter(out, in, ReduceOp::kSum, counts),
              c().reduce_scatter(out_max, in, ReduceOp::kMax, counts)});
    const int64_t start = std::accumulate(counts.begin(), counts.begin() + rank(), int64_t{0});
    at::Tensor mine = at::arange(start, start + counts[rank()], at::kLong).unsqueeze(1).repeat({1, 3});
    expect_same(out, (mine * n() + n() * (n() - 1) / 2).to(GetParam()));
    expect_same(out_max, (mine + n() - 1).to(GetParam()));
  }
}

TEST_P(CollectiveTest, AllGatherEvenAndUneven) {
  at::Tensor even = at::empty({2 * n(), 4}, opts());
  c().all_gather(even, at::full({2, 4}, rank() + 1, opts())).wait();
  for (int r = 0; r < n(); ++r) expect_same(even.narrow(0, 2 * r, 2), at::full({2, 4}, r + 1, opts()));

  // Uneven: rank r contributes r rows (rank 0 none).
  std::vector<int64_t> counts(n());
  std::iota(counts.begin(), counts.end(), 0);
  const int64_t rows = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  at::Tensor uneven = at::empty({rows, 2}, opts());
  c().all_gather(uneven, at::full({counts[rank()], 2}, 10 + rank(), opts()), counts).wait();
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n(); ++r) parts.push_back(at::full({counts[r], 2}, 10 + r, opts()));
  expect_same(uneven, at::cat(parts));
}

TEST_P(CollectiveTest, BroadcastFromEveryRoot) {
  for (int root = 0; root < n(); ++root) {
    at::Tensor x = rank_values(rank(), 33);
    c().broadcast(x, root).wait();
    expect_same(x, rank_values(root, 33));
  }
}

TEST_P(CollectiveTest, AllToAllEvenAndUneven) {
  // Even: block d of rank r holds 10*r + d; after the exchange block s holds 10*s + rank.
  at::Tensor in = (at::arange(n(), at::kLong) + 10 * rank()).repeat_interleave(2).to(GetParam());
  at::Tensor out = at::empty({2 * n()}, opts());
  c().all_to_all(out, in).wait();
  expect_same(out, (at::arange(n(), at::kLong) * 10 + rank()).repeat_interleave(2).to(GetParam()));

  // Uneven: rank r sends d + 1 rows to rank d (so receives rank + 1 rows from each).
  std::vector<int64_t> in_splits, out_splits;
  std::vector<at::Tensor> sent, expected;
  for (int d = 0; d < n(); ++d) {
    in_splits.push_back(d + 1);
    out_splits.push_back(rank() + 1);
    sent.push_back(at::full({d + 1, 2}, 10 * rank() + d, opts()));
    expected.push_back(at::full({rank() + 1, 2}, 10 * d + rank(), opts()));
  }
  at::Tensor got = at::empty({n() * (rank() + 1), 2}, opts());
  c().all_to_all(got, at::cat(sent), out_splits, in_splits).wait();
  expect_same(got, at::cat(expected));

  // Splits that look even on one rank only: the last rank sends and receives
  // nothing, the others 1 or 2 rows (every rank must still run the same MPI call).
  auto rows = [&](int from, int to) -> int64_t { return from < n() - 1 && to < n() - 1 ? 1 + (from + to) % 2 : 0; };
  in_splits.clear(), out_splits.clear(), sent.clear(), expected.clear();
  for (int d = 0; d < n(); ++d) {
    in_splits.push_back(rows(rank(), d));
    out_splits.push_back(rows(d, rank()));
    sent.push_back(at::full({rows(rank(), d), 2}, 10 * rank() + d, opts()));
    expected.push_back(at::full({rows(d, rank()), 2}, 10 * d + rank(), opts()));
  }
  const at::Tensor want = at::cat(expected);
  got = at::empty(want.sizes(), opts());
  c().all_to_all(got, at::cat(sent), out_splits, in_splits).wait();
  expect_same(got, want);
}

TEST_P(CollectiveTest, SendRecvRingBothWays) {
  const int next = (rank() + 1) % n(), prev = (rank() + n() - 1) % n();
  at::Tensor to_next = rank_values(rank(), 17), to_prev = rank_values(rank(), 17) * 2;
  at::Tensor from_prev = at::empty({17}, opts()), from_next = at::empty({17}, opts());
  // Issued sends first on every rank: p2p must not block the queue.
  wait_all({c().send(to_next, next, 1), c().send(to_prev, prev, 2), c().recv(from_prev, prev, 1),
            c().recv(from_next, next, 2)});
  expect_same(from_prev, rank_values(prev, 17));
  expect_same(from_next, rank_values(next, 17) * 2);
}

TEST(Collective, LargeAllReduceAndBroadcast) {
  Communicator& c = *world();
  const int64_t numel = int64_t{4} << 20;  // 16 MiB of float32: the large-message algorithms
  at::Tensor x = at::full({numel}, c.rank() + 1, at::kFloat);
  c.all_reduce(x).wait();
  EXPECT_TRUE(at::equal(x, at::full({numel}, c.size() * (c.size() + 1) / 2, at::kFloat)));
  at::Tensor y = at::full({numel}, c.rank(), at::kFloat);
  c.broadcast(y, c.size() - 1).wait();
  EXPECT_TRUE(at::equal(y, at::full({numel}, c.size() - 1, at::kFloat)));
}

TEST(Collective, LargeSendRecvBothDirectionsDoNotDeadlock) {
  Communicator& c = *world();
  if (c.size() < 2) GTEST_SKIP() << "needs a peer";
  // Pairs (0,1), (2,3), ...; a rank without a partner sits out.
  const int partner = c.rank() ^ 1;
  if (partner >= c.size()) return;
  const int64_t numel = int64_t{1} << 20;  // rendezvous-sized messages
  at::Tensor out = at::full({numel}, c.rank(), at::kFloat), in = at::empty({numel}, at::kFloat);
  Work sent = c.send(out, partner);  // both partners send before receiving
  Work received = c.recv(in, partner);
  wait_all({sent, received});
  EXPECT_TRUE(at::equal(in, at::full({numel}, partner, at::kFloat)));
}

TEST(Collective, AsyncOpsOverlapAndCompleteInOrder) {
  Communicator& c = *world();
  std::vector<at::Tensor> tensors;
  std::vector<Work> works;
  for (int i = 0; i < 16; ++i) {
    tensors.push_back(at::full({256 + i}, i + c.rank(), at::kLong));
    works.push_back(c.all_reduce(tensors.back()));
  }
  // Nothing waited on yet: all 16 are in flight or queued. The last one done
  // implies the others are (one queue, issue order).
  works.back().wait();
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(works[i].completed()) << i;
  wait_all(works);
  const int64_t n = c.size();
  for (int i = 0; i < 16; ++i) {
    EXPECT_TRUE(at::equal(tensors[i], at::full({256 + i}, n * i + n * (n - 1) / 2, at::kLong))) << i;
  }
}

TEST(Collective, CommunicatorsProgressIndependently) {
  // Two communicators over the same ranks, used in opposite orders on even and
  // odd ranks, waited on only at the end: each communicator's queue runs on its
  // own, so neither blocks the other.
  auto a = world()->split(0, world()->rank(), "test:a");
  auto b = world()->split(0, world()->rank(), "test:b");
  at::Tensor xa = at::ones({1000}, at::kFloat), xb = at::full({1000}, 2.0f, at::kFloat);
  std::vector<Work> works;
  if (world()->rank() % 2 == 0) {
    works.push_back(a->all_reduce(xa));
    works.push_back(b->all_reduce(xb));
  } else {
    works.push_back(b->all_reduce(xb));
    works.push_back(a->all_reduce(xa));
  }
  wait_all(works);
  EXPECT_TRUE(at::equal(xa, at::full({1000}, 1.0f * world()->size(), at::kFloat)));
  EXPECT_TRUE(at::equal(xb, at::full({1000}, 2.0f * world()->size(), at::kFloat)));
}

TEST(Collective, Barrier) {
  for (int i = 0; i < 3; ++i) world()->barrier().wait();
}

TEST(Split, ByParityOrderedByKey) {
  Communicator& c = *world();
  // key = -rank: ranks of a group are ordered by descending world rank.
  auto half = c.split(c.rank() % 2, -c.rank(), "test:parity");
  ASSERT_TRUE(half);
  std::vector<int> members;
  for (int r = c.rank() % 2; r < c.size(); r += 2) members.push_back(r);
  std::reverse(members.begin(), members.end());
  ASSERT_EQ(half->size(), static_cast<int>(members.size()));
  EXPECT_EQ(members[half->rank()], c.rank());
  at::Tensor gathered = at::empty({half->size()}, at::kInt);
  half->all_gather(gathered, at::full({1}, c.rank(), at::kInt)).wait();
  for (int i = 0; i < half->size(); ++i) EXPECT_EQ(gathered[i].item<int>(), members[i]);
  EXPECT_EQ(half->name(), "test:parity");
}

TEST(Split, NegativeColorTakesNoPart) {
  Communicator& c = *world();
  auto rest = c.split(c.rank() == 0 ? -1 : 0, c.rank(), "test:rest");
  if (c.rank() == 0) {
    EXPECT_FALSE(rest);
    return;
  }
  ASSERT_TRUE(rest);
  EXPECT_EQ(rest->size(), c.size() - 1);
  at::Tensor x = at::ones({3}, at::kInt);
  rest->all_reduce(x).wait();
  EXPECT_EQ(x[0].item<int>(), c.size() - 1);
}

TEST(Validation, BadArgumentsThrowBeforeCommunicating) {
  Communicator& c = *world();
  auto message_of = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const CommError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string prefix = "rank " + std::to_string(c.rank()) + ": communicator 'world': ";
  EXPECT_NE(message_of([&] { c.all_reduce(at::ones({4, 4}).t().contiguous().t()).wait(); })
                .find(prefix + "all_reduce(float32[4, 4], sum): the tensor must be contiguous"),
            std::string::npos);
  EXPECT_NE(message_of([&] { c.all_reduce(at::ones({2}, at::kComplexFloat)).wait(); }).find("is not supported"),
            std::string::npos);
  EXPECT_NE(message_of([&] { c.all_reduce(at::ones({2}, at::kBool)).wait(); }).find("for reductions"),
            std::string::npos);
  const std::vector<int64_t> too_many(c.size() + 1, 1);
  EXPECT_NE(message_of([&] { c.reduce_scatter(at::empty({1}), at::ones({c.size() + 1}), ReduceOp::kSum, too_many); })
                .find("counts has " + std::to_string(c.size() + 1) + " entries but the communicator has " +
                      std::to_string(c.size()) + " ranks"),
            std::string::npos);
  if (c.size() > 1) {
    EXPECT_NE(message_of([&] { c.reduce_scatter(at::empty({1}), at::ones({c.size() + 1})).wait(); })
                  .find("not divisible by " + std::to_string(c.size()) + " ranks; pass per-rank counts"),
              std::string::npos);
  }
  EXPECT_NE(message_of([&] { c.broadcast(at::ones({1}), c.size()).wait(); }).find("root " + std::to_string(c.size()) +
                                                                                     " is outside"),
            std::string::npos);
  EXPECT_NE(message_of([&] { c.send(at::ones({1}), -1).wait(); }).find("destination -1 is outside"),
            std::string::npos);
  // The communicator is still usable: nothing was enqueued.
  at::Tensor x = at::ones({1});
  c.all_reduce(x).wait();
  EXPECT_EQ(x.item<float>(), c.size());
}

TEST(DesyncCheck, ReportsBothSignatures) {
  Communicator& c = *world();
  if (c.size() < 2) GTEST_SKIP() << "a desync needs two ranks";
  CommOptions checked = c.options();
  checked.desync_check = true;
  auto comm = c.split(0, c.rank(), "test:desync", checked);
  at::Tensor x = at::ones({4, c.rank() == 0 ? 8 : 9});
  std::string message;
  try {
    comm->all_reduce(x).wait();
  } catch (const DesyncError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("desync at collective #0: ranks issued different collectives"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0: all_reduce(float32[4, 8], sum) #0"), std::string::npos) << message;
  EXPECT_NE(message.find(": all_reduce(float32[4, 9], sum) #0"), std::string::npos) << message;
  // Nobody ran the mismatched op; matching ops still work.
  at::Tensor y = at::ones({3});
  comm->all_reduce(y).wait();
  EXPECT_EQ(y[0].item<float>(), c.size());
}

TEST(Stats, CountWireBytesOfRingAlgorithms) {
  Communicator& c = *world();
  auto comm = c.split(0, c.rank(), "test:stats");
  const int64_t n = c.size();
  comm->all_reduce(at::ones({1000})).wait();
  comm->all_gather(at::empty({10 * n}), at::ones({10})).wait();
  const CommStats stats = comm->stats();
  EXPECT_EQ(stats[OpKind::kAllReduce].calls, 1);
  EXPECT_EQ(stats[OpKind::kAllReduce].payload_bytes, 4000);
  EXPECT_EQ(stats[OpKind::kAllReduce].wire_bytes, 2 * (n - 1) * 4000 / n);
  EXPECT_EQ(stats[OpKind::kAllGather].wire_bytes, (n - 1) * 40 * n / n);
}

}  // namespace
}  // namespace meshtrain::comm
