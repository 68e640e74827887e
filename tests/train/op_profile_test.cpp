// The products table of `bench train --profile` (train/op_profile.h): each
// product's FLOPs from the operand sizes the profiler records.
#include "meshtrain/train/op_profile.h"

#include <gtest/gtest.h>

namespace meshtrain::train {
namespace {

TEST(ProductFlops, CountsTwoMultiplyAddsPerOutputElementAndStep) {
  EXPECT_DOUBLE_EQ(product_flops("aten::mm", {{2048, 384}, {384, 1536}}), 2.0 * 2048 * 384 * 1536);
  // addmm(self, mat1, mat2, beta, alpha) and addmm_: the bias first, then the product's operands.
  EXPECT_DOUBLE_EQ(product_flops("aten::addmm", {{1536}, {2048, 384}, {384, 1536}, {}, {}}), 2.0 * 2048 * 384 * 1536);
  EXPECT_DOUBLE_EQ(product_flops("aten::addmm_", {{64, 32}, {64, 16}, {16, 32}, {}, {}}), 2.0 * 64 * 16 * 32);
  EXPECT_DOUBLE_EQ(product_flops("aten::bmm", {{48, 128, 64}, {48, 64, 256}}), 2.0 * 48 * 128 * 64 * 256);
  EXPECT_DOUBLE_EQ(product_flops("aten::baddbmm", {{48, 128, 256}, {48, 128, 64}, {48, 64, 256}, {}, {}}),
                   2.0 * 48 * 128 * 64 * 256);
}

TEST(ProductFlops, IsZeroForOtherOperatorsAndSizesItCannotRead) {
  EXPECT_EQ(product_flops("aten::add", {{4, 4}, {4, 4}}), 0);
  EXPECT_EQ(product_flops("aten::mm", {}), 0);                      // no shapes recorded
  EXPECT_EQ(product_flops("aten::mm", {{4, 4, 4}, {4, 4, 4}}), 0);  // not matrices
  EXPECT_EQ(product_flops("aten::bmm", {{4, 4}, {4, 4}}), 0);       // not batches
  EXPECT_EQ(product_flops("aten::addmm", {{4, 4}, {4, 4}}), 0);     // the second operand missing
}

}  // namespace
}  // namespace meshtrain::train
