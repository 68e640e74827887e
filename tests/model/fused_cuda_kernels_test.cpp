// The GPU's fused kernels (model/fused/kernels_cuda.cuh), run by the CPU
// emulation of blocks and threads (tests/harness/cuda_emulation.h), against
// the CPU's default table on the same inputs: every entry the GPU table has,
// fp32 and bf16, with and without the optional operands, rows wider than a
// block and more rows than a column slice. On a GPU, tests/cuda/ runs the
// compiled kernels through the model's operators.
#include "tests/harness/cuda_emulation.h"
// The emulation's macros first.
#include "meshtrain/model/fused/kernels_cuda.cuh"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace meshtrain::model::fused::kernel {
namespace {

const Table& emulated() {
  static const Table t = gpu::emulated::make_gpu_table();
  return t;
}

Dt dt_of(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? Dt::kFloat : Dt::kBFloat16; }

at::Tensor random(std::vector<int64_t> sizes, at::ScalarType dtype, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen, at::kFloat, {}, {}, {}).to(dtype);
}

void expect_close(const at::Tensor& gpu, const at::Tensor& cpu, const std::string& what) {
  const bool bf16 = cpu.scalar_type() == at::kBFloat16;
  // bf16: the two may round an fp32 result that differs in its last bits to neighbouring bf16 values.
  EXPECT_TRUE(at::allclose(gpu.to(at::kFloat), cpu.to(at::kFloat), bf16 ? 1e-2 : 1e-4, bf16 ? 1e-2 : 1e-5))
      << what << ": largest difference " << (gpu.to(at::kFloat) - cpu.to(at::kFloat)).abs().max().item<float>();
}

const void* cptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }
void* mptr(const at::Tensor& t) { return t.defined() ? t.mutable_data_ptr() : nullptr; }
const float* fptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr<float>() : nullptr; }
float* fmut(const at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<float>() : nullptr; }

struct NormCase {
  int64_t rows, width;
  bool rms, residual, bias;
  at::ScalarType dtype;
};

TEST(FusedCudaKernels, AddNormForwardAndBackwardFollowTheCpuKernels) {
  for (const NormCase c : {NormCase{3, 300, false, true, true, at::kFloat}, NormCase{3, 300, true, true, false, at::kFloat},
                           NormCase{70, 40, false, false, true, at::kFloat}, NormCase{3, 300, false, true, true, at::kBFloat16},
                           NormCase{2, 513, true, false, false, at::kBFloat16}}) {
    const std::string what = std::string(c.rms ? "rms" : "layer") + " norm, width " + std::to_string(c.width) +
                             (c.dtype == at::kFloat ? " fp32" : " bf16");
    SCOPED_TRACE(what);
    Norm n;
    n.rows = c.rows, n.width = c.width, n.rms = c.rms, n.eps = 1e-5f;
    const at::Tensor x = random({c.rows, c.width}, c.dtype, 1), r = c.residual ? random({c.rows, c.width}, c.dtype, 2) : at::Tensor();
    const at::Tensor weight = random({c.width}, at::kFloat, 3), bias = c.bias ? random({c.width}, at::kFloat, 4) : at::Tensor();
    n.weight = fptr(weight), n.bias = fptr(bias);
    const Table* tables[2] = {&emulated(), &default_table};
    at::Tensor h[2], y[2], mean[2], rstd[2];
    for (int k = 0; k < 2; ++k) {
      h[k] = c.residual ? at::empty_like(x) : x;
      y[k] = at::empty_like(x);
      mean[k] = at::empty({c.rows}), rstd[k] = at::empty({c.rows});
      tables[k]->add_norm_forward(n, cptr(x), dt_of(x), cptr(r), dt_of(x), c.residual ? mptr(h[k]) : nullptr, dt_of(x),
                                  mptr(y[k]), dt_of(x), fmut(mean[k]), fmut(rstd[k]));
    }
    expect_close(h[0], h[1], "h"), expect_close(y[0], y[1], "y");
    expect_close(mean[0], mean[1], "mean"), expect_close(rstd[0], rstd[1], "rstd");
    const at::Tensor dy = random({c.rows, c.width}, c.dtype, 5), dh = c.residual ? random({c.rows, c.width}, c.dtype, 6) : at::Tensor();
    at::Tensor dx[2], dr[2], dw[2], db[2];
    for (int k = 0; k < 2; ++k) {
      dx[k] = at::empty_like(x), dr[k] = c.residual ? at::empty_like(x) : at::Tensor();
      dw[k] = at::ones({c.width}), db[k] = c.bias ? at::ones({c.width}) : at::Tensor();  // accumulated into
      tables[k]->add_norm_backward(n, cptr(h[1]), dt_of(x), cptr(dy), dt_of(dy), cptr(dh), dt_of(x), fptr(mean[1]),
                                   fptr(rstd[1]), mptr(dx[k]), dt_of(x), mptr(dr[k]), dt_of(x), fmut(dw[k]), fmut(db[k]));
    }
    expect_close(dx[0], dx[1], "dx"), expect_close(dw[0], dw[1], "dweight");
    if (c.residual) expect_close(dr[0], dr[1], "dr");
    if (c.bias) expect_close(db[0], db[1], "dbias");
  }
}

TEST(FusedCudaKernels, GeluAndGluFollowTheCpuKernels) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(dtype == at::kFloat ? "fp32" : "bf16");
    const int64_t rows = 70, width = 37;  // rows: two column slices; width: not a block's multiple
    const at::Tensor a = random({rows, width}, dtype, 11), bias = random({width}, at::kFloat, 12);
    const at::Tensor dy = random({rows, width}, dtype, 13);
    const Table* tables[2] = {&emulated(), &default_table};
    for (const bool with_bias : {true, false}) {
      at::Tensor y[2], da[2], db[2];
      for (int k = 0; k < 2; ++k) {
        y[k] = at::empty_like(a), da[k] = at::empty_like(a), db[k] = at::zeros({width});
        tables[k]->bias_gelu_forward(rows, width, cptr(a), dt_of(a), with_bias ? fptr(bias) : nullptr, mptr(y[k]), dt_of(a));
        tables[k]->bias_gelu_backward(rows, width, cptr(a), dt_of(a), with_bias ? fptr(bias) : nullptr, cptr(dy), dt_of(dy),
                                      mptr(da[k]), dt_of(a), with_bias ? fmut(db[k]) : nullptr);
      }
      expect_close(y[0], y[1], "gelu"), expect_close(da[0], da[1], "gelu's da");
      if (with_bias) expect_close(db[0], db[1], "gelu's dbias");
    }
    const at::Tensor g = random({1000}, dtype, 14), u = random({1000}, dtype, 15), dglu = random({1000}, dtype, 16);
    for (const bool gelu : {false, true}) {
      at::Tensor y[2], dg[2], du[2];
      for (int k = 0; k < 2; ++k) {
        y[k] = at::empty_like(g), dg[k] = at::empty_like(g), du[k] = at::empty_like(g);
        tables[k]->glu_forward(g.numel(), cptr(g), cptr(u), mptr(y[k]), dt_of(g), gelu);
        tables[k]->glu_backward(g.numel(), cptr(g), cptr(u), cptr(dglu), mptr(dg[k]), mptr(du[k]), dt_of(g), gelu);
      }
      expect_close(y[0], y[1], gelu ? "geglu" : "swiglu");
      expect_close(dg[0], dg[1], "dg"), expect_close(du[0], du[1], "du");
    }
  }
}

TEST(FusedCudaKernels, CrossEntropyAndAddIntoFollowTheCpuKernels) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(dtype == at::kFloat ? "fp32" : "bf16");
    const int64_t rows = 5, vocab = 700;
    const at::Tensor logits = (random({rows, vocab}, at::kFloat, 21) * 4).to(dtype);
    const at::Tensor targets = at::tensor(std::vector<int64_t>{3, -100, 699, 0, 700});  // 700: no share holds it
    const Table* tables[2] = {&emulated(), &default_table};
    at::Tensor lse[2], loss[2], d[2];
    for (int k = 0; k < 2; ++k) {
      lse[k] = at::empty({rows}), loss[k] = at::empty({rows}), d[k] = at::empty_like(logits);
      tables[k]->cross_entropy_forward(rows, vocab, cptr(logits), dt_of(logits), targets.const_data_ptr<int64_t>(), -100,
                                       fmut(lse[k]), fmut(loss[k]));
    }
    for (int k = 0; k < 2; ++k) {  // both from the CPU's lse
      tables[k]->cross_entropy_backward(rows, vocab, cptr(logits), dt_of(logits), targets.const_data_ptr<int64_t>(), -100,
                                        fptr(lse[1]), 0.25f, mptr(d[k]));
    }
    expect_close(lse[0], lse[1], "lse"), expect_close(loss[0], loss[1], "loss"), expect_close(d[0], d[1], "dlogits");
    EXPECT_EQ(loss[0][1].item<float>(), 0.0f) << "an ignored row";
    EXPECT_EQ(d[0][1].abs().max().item<float>(), 0.0f) << "an ignored row's gradient";
    EXPECT_EQ(loss[0][4].item<float>(), lse[0][4].item<float>()) << "a target outside the vocabulary: the row's lse";
    const at::Tensor x = random({1500}, dtype, 22);
    at::Tensor y[2] = {random({1500}, at::kFloat, 23), random({1500}, at::kFloat, 23)};
    for (int k = 0; k < 2; ++k) tables[k]->add_into(x.numel(), cptr(x), dt_of(x), fmut(y[k]));
    expect_close(y[0], y[1], "add_into");
  }
  // The GPU has no kernel for these; callers compose ATen's operators on a GPU.
  EXPECT_EQ(emulated().rope, nullptr);
  EXPECT_EQ(emulated().attention_softmax_forward, nullptr);
  EXPECT_EQ(emulated().sum_squares, nullptr);
}

}  // namespace
}  // namespace meshtrain::model::fused::kernel
