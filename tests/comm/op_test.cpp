// Op descriptions, signatures (what the desync check compares) and split helpers.
#include "meshtrain/comm/op.h"

#include <gtest/gtest.h>

namespace meshtrain::comm {
namespace {

Op op_of(OpKind kind, at::Tensor input, at::Tensor output = {}) {
  Op op;
  op.kind = kind;
  op.input = input;
  op.output = output.defined() ? output : input;
  return op;
}

TEST(Op, DescribeNamesKindDtypeShapeAndReduce) {
  Op all_reduce = op_of(OpKind::kAllReduce, at::ones({4, 8}));
  all_reduce.reduce = ReduceOp::kMax;
  EXPECT_EQ(all_reduce.describe(), "all_reduce(float32[4, 8], max)");
  Op broadcast = op_of(OpKind::kBroadcast, at::ones({3}, at::kBFloat16));
  broadcast.peer = 2;
  EXPECT_EQ(broadcast.describe(), "broadcast(bfloat16[3], root=2)");
  EXPECT_EQ(op_of(OpKind::kAllToAll, at::ones({5, 2}, at::kHalf)).describe(), "all_to_all(float16[*, 2])");
  EXPECT_EQ(op_of(OpKind::kBarrier, {}).describe(), "barrier()");
}

TEST(OpSignature, EqualOnlyWhenRanksMustAgree) {
  Op a = op_of(OpKind::kAllReduce, at::ones({4, 8}));
  Op b = op_of(OpKind::kAllReduce, at::ones({4, 8}));
  EXPECT_EQ(OpSignature::of(a), OpSignature::of(b));
  b.sequence = 1;
  EXPECT_NE(OpSignature::of(a), OpSignature::of(b));
  EXPECT_NE(OpSignature::of(a), OpSignature::of(op_of(OpKind::kAllReduce, at::ones({4, 9}))));
  EXPECT_NE(OpSignature::of(a), OpSignature::of(op_of(OpKind::kAllReduce, at::ones({4, 8}, at::kDouble))));
  Op mx = a;
  mx.reduce = ReduceOp::kMax;
  EXPECT_NE(OpSignature::of(a), OpSignature::of(mx));
  // all_to_all inputs may differ in dim 0 across ranks.
  EXPECT_EQ(OpSignature::of(op_of(OpKind::kAllToAll, at::ones({3, 2}))),
            OpSignature::of(op_of(OpKind::kAllToAll, at::ones({5, 2}))));
  // all_gather ranks agree on the output, not the (uneven) input.
  EXPECT_EQ(OpSignature::of(op_of(OpKind::kAllGather, at::ones({1}), at::ones({3}))),
            OpSignature::of(op_of(OpKind::kAllGather, at::ones({2}), at::ones({3}))));
  EXPECT_EQ(OpSignature::of(a).describe(), "all_reduce(float32[4, 8], sum) #0");
}

TEST(OpSignature, CompareGroupsRanksByWhatTheyIssued) {
  const OpSignature good = OpSignature::of(op_of(OpKind::kAllReduce, at::ones({4, 8})));
  const OpSignature bad = OpSignature::of(op_of(OpKind::kAllReduce, at::ones({4, 9})));
  EXPECT_EQ(compare_signatures({good, good, good}), "");
  EXPECT_EQ(compare_signatures({good, bad, good}),
            "ranks 0,2: all_reduce(float32[4, 8], sum) #0; rank 1: all_reduce(float32[4, 9], sum) #0");
}

TEST(Op, EvenCountsAndWireBytes) {
  EXPECT_EQ(even_counts(10, 4), std::vector<int64_t>({3, 3, 2, 2}));
  EXPECT_EQ(even_counts(2, 4), std::vector<int64_t>({1, 1, 0, 0}));
  EXPECT_THROW(even_counts(3, 0), std::invalid_argument);
  Op all_reduce = op_of(OpKind::kAllReduce, at::ones({1000}));
  EXPECT_EQ(all_reduce.wire_bytes(4, 0), 2 * 3 * 4000 / 4);
  EXPECT_EQ(all_reduce.wire_bytes(1, 0), 0);
  Op reduce_scatter = op_of(OpKind::kReduceScatter, at::ones({400}), at::ones({100}));
  EXPECT_EQ(reduce_scatter.wire_bytes(4, 1), 3 * 1600 / 4);
}

}  // namespace
}  // namespace meshtrain::comm
