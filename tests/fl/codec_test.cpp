// Communication-efficient updates (fl/codec.h): the rotation is orthogonal and
// inverted exactly, the sketches are unbiased, structures reconstruct, the
// bytes sent match the formula and the wire, and malformed updates are errors.
#include "meshtrain/fl/codec.h"
#include "meshtrain/fl/strategy.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

namespace meshtrain::fl {
namespace {

at::Generator gen(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

TEST(FlCodec, RotationIsOrthogonalAndInvertedExactly) {
  for (int64_t n : {1, 5, 64, 1000}) {
    const at::Tensor x = at::randn({n});
    const at::Tensor y = rotate(x, 7);
    EXPECT_EQ(y.numel() & (y.numel() - 1), 0) << "padded to a power of two";
    EXPECT_NEAR(y.norm().item<double>(), x.norm().item<double>(), 1e-4 * (1 + x.norm().item<double>()));
    EXPECT_TRUE(at::allclose(unrotate(y, 7, n), x, 1e-5, 1e-5)) << n;
    // Another seed gives another rotation.
    if (n > 4) EXPECT_FALSE(at::allclose(rotate(x, 8), y));
  }
}

TEST(FlCodec, QuantiserIsUnbiasedAndWithinRange) {
  const at::Tensor x = at::randn({256});
  for (int64_t bits : {1, 2, 4}) {
    at::Tensor mean = at::zeros_like(x);
    const int trials = 2000;
    for (int s = 0; s < trials; ++s) {
      at::Generator g = gen(static_cast<uint64_t>(s));
      const Quantised q = quantise(x, bits, g);
      EXPECT_EQ(static_cast<int64_t>(q.packed.size()), (x.numel() * bits + 7) / 8);
      const at::Tensor d = dequantise(q.packed, x.numel(), bits, q.lo, q.hi);
      ASSERT_GE(d.min().item<float>(), q.lo - 1e-6);
      ASSERT_LE(d.max().item<float>(), q.hi + 1e-6);
      mean += d;
    }
    mean /= trials;
    // Per entry the rounding has variance <= step²/4: the mean's error is ~step/(2·sqrt(trials)).
    const double step = (x.max() - x.min()).item<double>() / ((1 << bits) - 1);
    EXPECT_LT((mean - x).abs().max().item<double>(), 5 * step / (2 * std::sqrt(trials))) << bits << " bits";
  }
}

TEST(FlCodec, SubsamplingAndRotationAreUnbiased) {
  CompressionSpec spec;
  spec.rotate = true;
  spec.keep = 0.25;
  const at::Tensor x = at::randn({100});
  at::Tensor mean = at::zeros_like(x);
  const int trials = 3000;
  for (int s = 0; s < trials; ++s) {
    const at::Tensor v = sketch_values(x, spec, static_cast<uint64_t>(s));
    EXPECT_EQ(v.numel(), kept_entries(spec, static_cast<uint64_t>(s), x.numel()));
    mean += unsketch_values(v, spec, static_cast<uint64_t>(s), x.numel());
  }
  mean /= trials;
  // Each decoded entry has variance ~ (1/keep - 1)·|x|²/n.
  const double sd = std::sqrt((1 / spec.keep - 1) * x.pow(2).sum().item<double>() / 128 / trials);
  EXPECT_LT((mean - x).abs().max().item<double>(), 5 * sd);
}

TEST(FlCodec, StructuresReconstruct) {
  CompressionSpec low;
  low.structure = "low_rank";
  low.rank = 3;
  const Structure lr(low, {16, 10}, 5);
  EXPECT_STREQ(lr.kind(), "low_rank");
  EXPECT_EQ(lr.payload_size(), 3 * 10);
  const at::Tensor b = at::randn({30});
  const at::Tensor w = lr.expand(b);
  ASSERT_EQ(w.sizes(), (std::vector<int64_t>{16, 10}));
  EXPECT_EQ(at::linalg_matrix_rank(w).item<int64_t>(), 3);
  // Chain rule: <grad, expand(p)> = <project(grad), p> for every p.
  const at::Tensor grad = at::randn({16, 10});
  EXPECT_NEAR((grad * w).sum().item<double>(), (lr.project(grad) * b).sum().item<double>(), 1e-4);
  // Same seed, same A (server and clients agree); vectors and narrow matrices go whole.
  EXPECT_TRUE(at::equal(Structure(low, {16, 10}, 5).expand(b), w));
  EXPECT_STREQ(Structure(low, {16}, 5).kind(), "full");
  EXPECT_STREQ(Structure(low, {16, 2}, 5).kind(), "full");

  CompressionSpec masked;
  masked.structure = "mask";
  masked.mask_fraction = 0.3;
  const Structure m(masked, {40, 25}, 9);
  EXPECT_NEAR(static_cast<double>(m.payload_size()) / 1000, 0.3, 0.06);
  const at::Tensor p = at::randn({m.payload_size()});
  const at::Tensor full = m.expand(p);
  EXPECT_EQ(full.ne(0).sum().item<int64_t>(), m.payload_size());
  EXPECT_TRUE(at::equal(m.project(full), p));
}

TEST(FlCodec, EncodedBytesMatchTheFormulaAndTheWire) {
  at::Generator g = gen(1);
  const at::Tensor payload = at::randn({1000});
  for (const auto& [rotate, keep, bits] : std::vector<std::tuple<bool, double, int64_t>>{
           {false, 1.0, 0}, {false, 1.0, 2}, {true, 0.0625, 2}, {true, 0.5, 8}, {false, 0.25, 0}}) {
    CompressionSpec spec;
    spec.rotate = rotate;
    spec.keep = keep;
    spec.bits = bits;
    const wire::EncodedTensor e = encode(payload, spec, 42, 3, g);
    const int64_t kept = kept_entries(spec, 42, 1000);
    EXPECT_EQ(static_cast<int64_t>(e.values().size()), expected_value_bytes(kept, bits)) << spec.describe();
    EXPECT_EQ(static_cast<int64_t>(e.values().size()), bits == 0 ? 4 * kept : (kept * bits + 7) / 8);
    EXPECT_EQ(e.ByteSizeLong(), e.SerializeAsString().size());
    const at::Tensor d = decode(e, spec, 1000);
    EXPECT_EQ(d.numel(), 1000);
    if (!spec.sketched() || (!rotate && keep == 1.0 && bits == 0)) EXPECT_TRUE(at::equal(d, payload));
  }
  // Rotation + 6.25% + 2 bits: the paper's 256x fewer bits than float32.
  CompressionSpec paper;
  paper.rotate = true;
  paper.keep = 0.0625;
  paper.bits = 2;
  const at::Tensor big = at::randn({65536});
  const wire::EncodedTensor e = encode(big, paper, 3, 0, g);
  EXPECT_NEAR(65536.0 * 4 / static_cast<double>(e.values().size()), 256.0, 20.0);
}

TEST(FlCodec, MalformedUpdatesAreErrorsNotCrashes) {
  at::Generator g = gen(2);
  CompressionSpec spec;
  spec.bits = 4;
  const wire::EncodedTensor good = encode(at::randn({100}), spec, 5, 0, g);
  EXPECT_THROW(decode(good, spec, 99), std::runtime_error);  // wrong length
  wire::EncodedTensor e = good;
  e.set_values(e.values().substr(1));
  EXPECT_THROW(decode(e, spec, 100), std::runtime_error);  // truncated values
  e = good;
  e.set_lo(std::nanf(""));
  EXPECT_THROW(decode(e, spec, 100), std::runtime_error);  // bad range
  e = good;
  e.set_bits(2);
  EXPECT_THROW(decode(e, spec, 100), std::runtime_error);  // not the round's bits
  CompressionSpec plain;
  wire::EncodedTensor f = encode(at::randn({10}), plain, 5, 0, g);
  std::string bytes = f.values();
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(bytes.data(), &inf, 4);
  f.set_values(bytes);
  EXPECT_THROW(decode(f, plain, 10), std::runtime_error);  // not finite
  wire::EncodedTensor junk;
  EXPECT_FALSE(junk.ParseFromString(std::string("\xff\xff\xff\xff garbage", 13)));
  EXPECT_THROW(CompressionSpec::from_wire([] {
                 wire::Compression c;
                 c.set_structure("sparse");
                 return c;
               }()),
               std::invalid_argument);
}

TEST(FlStrategy, FedAvgFedAdamFedYogi) {
  const std::vector<std::vector<at::Tensor>> updates{{at::full({3}, 1.0)}, {at::full({3}, 4.0)}};
  const std::vector<at::Tensor> mean = weighted_mean(updates, {2.0, 1.0});
  EXPECT_TRUE(at::allclose(mean[0], at::full({3}, 2.0)));

  std::vector<at::Tensor> w{at::zeros({3})};
  Strategy avg(StrategyConfig{});
  avg.apply(w, mean);
  EXPECT_TRUE(at::allclose(w[0], mean[0]));

  for (const std::string name : {"fedadam", "fedyogi"}) {
    StrategyConfig c;
    c.name = name;
    c.server_lr = 0.1;
    Strategy s(c);
    std::vector<at::Tensor> x{at::zeros({3})};
    s.apply(x, mean);
    // Step 1 by hand: m = 0.1·Δ; v = τ² ± 0.01·Δ² (Adam: 0.99τ² + 0.01Δ²; Yogi: τ² + 0.01Δ² as v < Δ²).
    const double d = 2.0, tau = c.tau, m = 0.1 * d;
    const double v = name == "fedadam" ? 0.99 * tau * tau + 0.01 * d * d : tau * tau + 0.01 * d * d;
    EXPECT_NEAR(x[0][0].item<double>(), 0.1 * m / (std::sqrt(v) + tau), 1e-5) << name;
  }
  StrategyConfig bad;
  bad.name = "fedprox";
  EXPECT_THROW(Strategy{bad}, std::invalid_argument);  // needs mu
}

}  // namespace
}  // namespace meshtrain::fl
