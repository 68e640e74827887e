// Packed rows (Note [Batch]): several documents side by side in one
// row, each with positions from 0 and attention kept inside it, give every
// document the logits and the parameter gradients it has alone in a row —
// with RoPE (and GQA, a sliding window, partial rotary) and with learned
// positions, through the fused and the reference operators.
#include "meshtrain/model/attention.h"
#include "meshtrain/model/gpt.h"

#include <gtest/gtest.h>

namespace meshtrain::model {
namespace {

struct Style {
  std::string name;
  GptConfig config;
};

std::vector<Style> styles() {
  GptConfig llama = GptConfig::preset("llama-tiny");
  llama.layers = 2, llama.width = 64, llama.heads = 4, llama.kv_heads = 2, llama.context = 32, llama.dropout = 0;
  llama.vocab_size = 96;
  GptConfig windowed = llama;
  windowed.sliding_window = 3, windowed.rotary_fraction = 0.5;
  GptConfig gpt2 = GptConfig::preset("tiny");
  gpt2.layers = 2, gpt2.width = 64, gpt2.heads = 4, gpt2.context = 32, gpt2.dropout = 0;
  GptConfig reference = llama;
  reference.fused = false;
  return {{"llama style", llama}, {"window 3, half rotary", windowed}, {"gpt-2 (learned positions)", gpt2},
          {"llama style, reference operators", reference}};
}

TEST(PackedDocuments, EachDocumentComputesAsIfAlone) {
  const std::vector<int64_t> lengths = {5, 9, 2, 7};
  int64_t total = 0;
  for (int64_t n : lengths) total += n;
  for (const Style& style : styles()) {
    Gpt model(style.config, 3);
    const at::Tensor tokens = at::randint(0, style.config.vocab_size, {1, total}, at::kLong);
    at::Tensor positions = at::empty({1, total}, at::kLong);
    for (int64_t begin = 0, d = 0; d < static_cast<int64_t>(lengths.size()); begin += lengths[d++]) {
      positions.narrow(1, begin, lengths[d]).copy_(at::arange(lengths[d], at::kLong).unsqueeze(0));
    }
    // Packed: one forward, a loss per document summed.
    model->zero_grad();
    const at::Tensor packed_logits = model->forward(Batch::packed(tokens, {}, positions));
    at::Tensor packed_loss = at::zeros({});
    for (int64_t begin = 0, d = 0; d < static_cast<int64_t>(lengths.size()); begin += lengths[d++]) {
      packed_loss = packed_loss + packed_logits.narrow(1, begin, lengths[d]).logsumexp(-1).sum();
    }
    packed_loss.backward();
    std::map<std::string, at::Tensor> packed_grads;
    for (const auto& p : model->named_parameters()) packed_grads[p.key()] = p.value().grad().clone();
    // Alone: a forward per document.
    model->zero_grad();
    at::Tensor alone_loss = at::zeros({});
    for (int64_t begin = 0, d = 0; d < static_cast<int64_t>(lengths.size()); begin += lengths[d++]) {
      const at::Tensor logits = model->forward(tokens.narrow(1, begin, lengths[d]));
      EXPECT_TRUE(at::allclose(logits, packed_logits.narrow(1, begin, lengths[d]), 1e-5, 1e-5))
          << style.name << ", document " << d << ": largest difference "
          << (logits - packed_logits.narrow(1, begin, lengths[d])).abs().max().item<double>();
      alone_loss = alone_loss + logits.logsumexp(-1).sum();
    }
    alone_loss.backward();
    for (const auto& p : model->named_parameters()) {
      EXPECT_TRUE(at::allclose(p.value().grad(), packed_grads.at(p.key()), 1e-4, 1e-5))
          << style.name << ": gradient of " << p.key();
    }
    // Without the documents they see each other: the test can tell.
    EXPECT_FALSE(at::allclose(model->forward(tokens), packed_logits, 1e-3, 1e-3)) << style.name;
  }
}

}  // namespace
}  // namespace meshtrain::model
