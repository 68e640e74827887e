// Secure aggregation (fl/secagg.h), run in one process: the sum is exact with
// up to n - t dropouts at any step, a masked update looks like noise, fewer
// than t clients fail clearly, and the clients refuse what would leak.
#include "meshtrain/fl/secagg.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>
#include <set>

namespace meshtrain::fl::secagg {
namespace {

TEST(FlSecAgg, ShamirNeedsThresholdShares) {
  const Bytes secret = random_bytes(32);
  const std::vector<Share> shares = shamir_split(secret, 6, 3);
  EXPECT_EQ(shamir_combine({shares[0], shares[2], shares[5]}), secret);
  EXPECT_EQ(shamir_combine({shares[4], shares[1], shares[3]}), secret);
  EXPECT_EQ(shamir_combine(shares), secret);
  EXPECT_NE(shamir_combine({shares[0], shares[1]}), secret);
  EXPECT_THROW(shamir_combine({shares[0], shares[0], shares[1]}), SecAggError);
}

TEST(FlSecAgg, KeyAgreementIsSymmetric) {
  const KeyPair a = generate_keypair(), b = generate_keypair();
  EXPECT_EQ(agree(a.secret, b.public_key, "x"), agree(b.secret, a.public_key, "x"));
  EXPECT_NE(agree(a.secret, b.public_key, "x"), agree(a.secret, b.public_key, "y"));
  EXPECT_EQ(prg(agree(a.secret, b.public_key, "x"), 5), prg(agree(b.secret, a.public_key, "x"), 5));
}

struct ProtocolRun {
  std::vector<uint32_t> sum, expected;
  std::map<std::string, std::vector<uint32_t>> x, masked;
};

// n clients of length-m vectors; the clients in drop_before_mask send shares
// but no masked update; those in silent_at_unmask send the masked update but
// do not answer the unmasking step.
ProtocolRun run_protocol(int n, int t, const std::set<int>& drop_before_mask, const std::set<int>& silent_at_unmask,
                 size_t m = 64) {
  std::mt19937 rng(11);
  std::vector<std::unique_ptr<ClientSession>> clients;
  ServerSession server(t);
  ProtocolRun run;
  for (int i = 0; i < n; ++i) {
    const std::string id = "c" + std::to_string(i);
    clients.push_back(std::make_unique<ClientSession>(id, t));
    server.add_keys(id, clients.back()->keys());
    std::vector<uint32_t> x(m);
    for (auto& v : x) v = rng() % 65536;
    run.x[id] = x;
  }
  const std::vector<wire::PeerKeys> peers = server.peers();
  for (int i = 0; i < n; ++i) server.add_shares("c" + std::to_string(i), clients[i]->share(peers));
  run.expected.assign(m, 0);
  for (int i = 0; i < n; ++i) {
    if (drop_before_mask.count(i)) continue;
    const std::string id = "c" + std::to_string(i);
    run.masked[id] = clients[i]->mask(run.x[id], server.shares_for(id));
    server.add_masked(id, run.masked[id]);
    for (size_t k = 0; k < m; ++k) run.expected[k] += run.x[id][k];
  }
  for (int i = 0; i < n; ++i) {
    if (drop_before_mask.count(i) || silent_at_unmask.count(i)) continue;
    server.add_revealed("c" + std::to_string(i), clients[i]->reveal(server.survivors(), server.dropped()));
  }
  run.sum = server.sum();
  return run;
}

TEST(FlSecAgg, SumIsExactWithUpToNMinusTDropouts) {
  EXPECT_EQ(run_protocol(5, 3, {}, {}).sum, run_protocol(5, 3, {}, {}).expected);
  for (const auto& dropped : std::vector<std::set<int>>{{0}, {4}, {1, 3}, {0, 4}}) {
    const ProtocolRun r = run_protocol(5, 3, dropped, {});
    EXPECT_EQ(r.sum, r.expected) << dropped.size() << " dropped before masking";
  }
  // Survivors that go quiet while unmasking: fine while t answer.
  const ProtocolRun quiet = run_protocol(5, 3, {1}, {2});
  EXPECT_EQ(quiet.sum, quiet.expected);
}

TEST(FlSecAgg, BelowThresholdFailsClearly) {
  try {
    run_protocol(5, 3, {0, 1, 2}, {});
    FAIL() << "expected a SecAggError";
  } catch (const SecAggError& e) {
    EXPECT_NE(std::string(e.what()).find("threshold t = 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(run_protocol(5, 3, {0}, {1, 2}), SecAggError);  // 4 survivors, 2 answer
  ServerSession lonely(3);
  ClientSession a("a", 3), b("b", 3);
  lonely.add_keys("a", a.keys());
  lonely.add_keys("b", b.keys());
  EXPECT_THROW(lonely.peers(), SecAggError);
}

TEST(FlSecAgg, AMaskedUpdateIsUncorrelatedWithTheUpdate) {
  const ProtocolRun r = run_protocol(3, 2, {}, {}, 4096);
  const auto& x = r.x.at("c0");
  const auto& y = r.masked.at("c0");
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) mx += x[i], my += y[i];
  mx /= x.size(), my /= y.size();
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  EXPECT_LT(std::abs(sxy / std::sqrt(sxx * syy)), 0.06);
  // And its entries fill the ring, not the update's 16 bits.
  EXPECT_GT(*std::max_element(y.begin(), y.end()), 1u << 30);
}

TEST(FlSecAgg, ClientsRefuseToRevealBothSecretsAndTamperedShares) {
  ServerSession server(2);
  std::vector<std::unique_ptr<ClientSession>> c;
  for (int i = 0; i < 3; ++i) {
    c.push_back(std::make_unique<ClientSession>("c" + std::to_string(i), 2));
    server.add_keys("c" + std::to_string(i), c.back()->keys());
  }
  for (int i = 0; i < 3; ++i) server.add_shares("c" + std::to_string(i), c[i]->share(server.peers()));
  std::vector<wire::SealedShares> for_c0 = server.shares_for("c0");
  c[0]->mask({1, 2, 3}, for_c0);
  EXPECT_THROW(c[0]->reveal({"c0", "c1"}, {"c1"}), SecAggError);
  for_c0[0].mutable_ciphertext()->at(3) ^= 1;
  EXPECT_THROW(c[0]->mask({1, 2, 3}, for_c0), SecAggError);
}

TEST(FlSecAgg, RingQuantisationSumsBack) {
  const std::vector<float> a{0.1f, -0.2f, 0.3f}, b{-0.05f, 0.4f, 0.0f};
  std::vector<uint32_t> qa = quantise_ring(a, 0.5f, 16, 1), qb = quantise_ring(b, 0.5f, 16, 2), s(3);
  for (int i = 0; i < 3; ++i) s[i] = qa[i] + qb[i];
  const std::vector<float> sum = dequantise_ring_sum(s, 2, 0.5f, 16);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(sum[i], a[i] + b[i], 2.0 / 65535);
  EXPECT_THROW(quantise_ring({0.1f, std::nanf("")}, 0.5f, 16, 3), SecAggError);
  // Weighted by examples inside the ring: (3a + b) / 4.
  std::vector<uint32_t> wa = weight_by_examples(qa, 3), wb = weight_by_examples(qb, 1), ws(4);
  for (int i = 0; i < 4; ++i) ws[i] = wa[i] + wb[i];
  const std::vector<float> mean = weighted_mean_from_sum(ws, 0.5f, 16);
  ASSERT_EQ(mean.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(mean[i], (3 * a[i] + b[i]) / 4, 2.0 / 65535);
  std::vector<uint32_t> big = weight_by_examples(qa, 70000);
  EXPECT_THROW(weighted_mean_from_sum(big, 0.5f, 16), SecAggError);  // 70000 · 65535 > 2^32
}

}  // namespace
}  // namespace meshtrain::fl::secagg
