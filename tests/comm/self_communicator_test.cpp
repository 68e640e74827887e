// The one-rank world of a process without MPI (Note [Self communicator]):
// collectives leave one rank's data as it is, splits give one-rank groups,
// a send to oneself is buffered and received by tag in order, and a receive
// no send answers fails after the timeout instead of hanging.
#include "meshtrain/comm/backend/self/self_communicator.h"

#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

#include <chrono>

namespace meshtrain::comm {
namespace {

TEST(SelfCommunicator, CollectivesOfOneRankAndSplits) {
  CommOptions through_backend;
  through_backend.one_rank_through_backend = true;
  for (const CommOptions& options : {CommOptions{}, through_backend}) {
    auto world = SelfCommunicator::create("world", options);
    EXPECT_EQ(world->size(), 1);
    EXPECT_EQ(world->rank(), 0);
    at::Tensor x = at::arange(6, at::kFloat);
    world->all_reduce(x, ReduceOp::kAvg).wait();
    EXPECT_TRUE(x.equal(at::arange(6, at::kFloat)));
    at::Tensor gathered = at::zeros({6});
    world->all_gather(gathered, x).wait();
    EXPECT_TRUE(gathered.equal(x));
    at::Tensor shard = at::zeros({6});
    world->reduce_scatter(shard, x).wait();
    EXPECT_TRUE(shard.equal(x));
    world->barrier().wait();
    auto child = world->split(0, 0, "child");
    ASSERT_NE(child, nullptr);
    EXPECT_EQ(child->size(), 1);
    EXPECT_STREQ(child->backend_name(), "self");
    EXPECT_EQ(world->split(-1, 0, "none"), nullptr);
  }
}

TEST(SelfCommunicator, SendsAreReceivedByTagInOrderAndAnUnansweredReceiveFails) {
  CommOptions options;
  options.timeout = std::chrono::milliseconds(100);
  auto world = SelfCommunicator::create("world", options);
  at::Tensor a = at::full({3}, 1.0), b = at::full({3}, 2.0), c = at::full({3}, 3.0);
  world->send(a, 0, /*tag=*/7).wait();
  world->send(b, 0, /*tag=*/7).wait();
  a.fill_(-1);  // buffered: the send took its copy
  at::Tensor late = at::zeros({3});
  Work pending = world->recv(late, 0, /*tag=*/9);  // posted before its send
  EXPECT_FALSE(pending.completed());
  world->send(c, 0, /*tag=*/9).wait();
  pending.wait();
  EXPECT_TRUE(late.equal(c));
  at::Tensor first = at::zeros({3}), second = at::zeros({3});
  world->recv(first, 0, 7).wait();
  world->recv(second, 0, 7).wait();
  EXPECT_TRUE(first.equal(at::full({3}, 1.0)));
  EXPECT_TRUE(second.equal(b));

  at::Tensor never = at::zeros({3});
  const std::string unanswered = testing::error_of<CommError>([&] { world->recv(never, 0, 5).wait(); });
  EXPECT_NE(unanswered.find("no send of tag 5 within 100 ms"), std::string::npos) << unanswered;
  // The communicator still works after it, and the receive given up takes nothing.
  world->send(c, 0, 5).wait();
  at::Tensor again = at::zeros({3});
  world->recv(again, 0, 5).wait();
  EXPECT_TRUE(again.equal(c));
  EXPECT_TRUE(never.equal(at::zeros({3})));
  // A send that does not fit fails its receive, and is consumed by it.
  world->send(at::zeros({4}), 0, 2).wait();
  at::Tensor small = at::zeros({3});
  const std::string too_big = testing::error_of<CommError>([&] { world->recv(small, 0, 2).wait(); });
  EXPECT_NE(too_big.find("does not fit"), std::string::npos) << too_big;
  world->send(c, 0, 2).wait();
  world->recv(small, 0, 2).wait();
  EXPECT_TRUE(small.equal(c));
}

}  // namespace
}  // namespace meshtrain::comm
