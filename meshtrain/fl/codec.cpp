#include "meshtrain/fl/codec.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace meshtrain::fl {
namespace {

// Seed purposes: one stream each, so a rotation never reuses a mask's bits.
constexpr uint64_t kRotationSigns = 0x51, kSubsample = 0x52;

at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

int64_t padded_length(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// In place, unnormalised: x <- H·x for the Sylvester Hadamard matrix.
void walsh_hadamard(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h <<= 1) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

at::Tensor signs(uint64_t seed, int64_t n) {
  at::Generator g = generator(mix_seed(seed, kRotationSigns));
  return at::bernoulli(at::full({n}, 0.5), g).mul_(2).sub_(1);
}

at::Tensor subsample_mask(uint64_t seed, int64_t n, double keep) {
  at::Generator g = generator(mix_seed(seed, kSubsample));
  return at::rand({n}, g).lt(keep);
}

}  // namespace

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ULL;
  return h;
}

uint64_t mix_seed(uint64_t a, uint64_t b) {
  uint64_t z = a + 0x9e3779b97f4a7c15ULL * (b + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void CompressionSpec::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument("[fl.compression] " + what); };
  if (structure != "none" && structure != "low_rank" && structure != "mask")
    fail("structure = \"" + structure + "\": use \"none\", \"low_rank\" or \"mask\"");
  if (structure == "low_rank" && rank < 1) fail("rank = " + std::to_string(rank) + ": must be at least 1");
  if (structure == "mask" && !(mask_fraction > 0 && mask_fraction <= 1))
    fail("mask_fraction = " + std::to_string(mask_fraction) + ": must be in (0, 1]");
  if (!(keep > 0 && keep <= 1)) fail("keep = " + std::to_string(keep) + ": must be in (0, 1]");
  if (bits < 0 || bits > 16) fail("bits = " + std::to_string(bits) + ": use 0 (float32) or 1..16");
}

CompressionSpec CompressionSpec::from_wire(const wire::Compression& c) {
  CompressionSpec s;
  s.structure = c.structure().empty() ? "none" : c.structure();
  s.rank = c.rank();
  s.mask_fraction = c.mask_fraction();
  s.rotate = c.rotate();
  s.keep = c.keep() == 0 ? 1.0 : c.keep();
  s.bits = c.bits();
  s.validate();
  return s;
}

wire::Compression CompressionSpec::to_wire() const {
  wire::Compression c;
  c.set_structure(structure);
  c.set_rank(static_cast<uint32_t>(rank));
  c.set_mask_fraction(static_cast<float>(mask_fraction));
  c.set_rotate(rotate);
  c.set_keep(static_cast<float>(keep));
  c.set_bits(static_cast<uint32_t>(bits));
  return c;
}

std::string CompressionSpec::describe() const {
  std::ostringstream out;
  if (structure == "low_rank") out << "low_rank(" << rank << ")";
  else if (structure == "mask") out << "mask(" << mask_fraction << ")";
  else out << "full";
  if (rotate) out << "+rotate";
  if (keep < 1) out << "+keep(" << keep << ")";
  if (bits > 0) out << "+" << bits << "bit";
  return out.str();
}

Structure::Structure(const CompressionSpec& spec, at::IntArrayRef shape, uint64_t seed) : shape_(shape.vec()) {
  const int64_t numel = c10::multiply_integers(shape);
  payload_size_ = numel;
  if (spec.structure == "low_rank" && shape.size() == 2 && spec.rank < std::min(shape[0], shape[1])) {
    kind_ = Kind::kLowRank;
    at::Generator g = generator(seed);
    a_ = at::randn({shape[0], spec.rank}, g).div_(std::sqrt(static_cast<double>(shape[0])));
    payload_size_ = spec.rank * shape[1];
  } else if (spec.structure == "mask") {
    kind_ = Kind::kMask;
    at::Generator g = generator(seed);
    mask_ = at::rand({numel}, g).lt(spec.mask_fraction);
    payload_size_ = mask_.sum().item<int64_t>();
  }
}

const char* Structure::kind() const {
  switch (kind_) {
    case Kind::kLowRank: return "low_rank";
    case Kind::kMask: return "mask";
    default: return "full";
  }
}

at::Tensor Structure::expand(const at::Tensor& payload) const {
  switch (kind_) {
    case Kind::kLowRank: return at::mm(a_, payload.view({a_.size(1), shape_[1]}));
    case Kind::kMask: {
      at::Tensor full = at::zeros({mask_.numel()}, payload.options());
      full.masked_scatter_(mask_, payload);
      return full.view(shape_);
    }
    default: return payload.reshape(shape_);
  }
}

at::Tensor Structure::project(const at::Tensor& grad) const {
  switch (kind_) {
    case Kind::kLowRank: return at::mm(a_.t(), grad.reshape({shape_[0], shape_[1]})).reshape({-1});
    case Kind::kMask: return grad.reshape({-1}).masked_select(mask_);
    default: return grad.reshape({-1});
  }
}

at::Tensor rotate(const at::Tensor& x, uint64_t seed) {
  const int64_t n = padded_length(x.numel());
  at::Tensor y = at::zeros({n}, at::kFloat);
  y.narrow(0, 0, x.numel()).copy_(x.reshape({-1}));
  y.mul_(signs(seed, n));
  walsh_hadamard(y.data_ptr<float>(), n);
  return y.div_(std::sqrt(static_cast<double>(n)));
}

at::Tensor unrotate(const at::Tensor& y, uint64_t seed, int64_t length) {
  const int64_t n = y.numel();
  at::Tensor x = y.to(at::kFloat).contiguous().clone();
  walsh_hadamard(x.data_ptr<float>(), n);
  x.div_(std::sqrt(static_cast<double>(n))).mul_(signs(seed, n));
  return x.narrow(0, 0, length).clone();
}

at::Tensor sketch_values(const at::Tensor& payload, const CompressionSpec& spec, uint64_t seed) {
  at::Tensor v = payload.reshape({-1}).to(at::kFloat).contiguous();
  if (spec.rotate) v = rotate(v, seed);
  if (spec.keep < 1.0) v = v.masked_select(subsample_mask(seed, v.numel(), spec.keep)).div_(spec.keep);
  return v;
}

at::Tensor unsketch_values(const at::Tensor& values, const CompressionSpec& spec, uint64_t seed, int64_t length) {
  const int64_t n = spec.rotate ? padded_length(length) : length;
  at::Tensor v = values;
  if (spec.keep < 1.0) {
    at::Tensor full = at::zeros({n}, at::kFloat);
    full.masked_scatter_(subsample_mask(seed, n, spec.keep), values);
    v = full;
  }
  if (spec.rotate) v = unrotate(v, seed, length);
  return v;
}

int64_t kept_entries(const CompressionSpec& spec, uint64_t seed, int64_t length) {
  const int64_t n = spec.rotate ? padded_length(length) : length;
  if (spec.keep >= 1.0) return n;
  return subsample_mask(seed, n, spec.keep).sum().item<int64_t>();
}

int64_t expected_value_bytes(int64_t kept, int64_t bits) { return bits == 0 ? kept * 4 : (kept * bits + 7) / 8; }

Quantised quantise(const at::Tensor& values, int64_t bits, at::Generator& rng) {
  Quantised q;
  const int64_t n = values.numel();
  q.packed.assign(static_cast<size_t>(expected_value_bytes(n, bits)), '\0');
  if (n == 0) return q;
  q.lo = values.min().item<float>();
  q.hi = values.max().item<float>();
  const double levels = static_cast<double>((int64_t{1} << bits) - 1);
  const double span = q.hi > q.lo ? static_cast<double>(q.hi) - q.lo : 1.0;
  // t in [0, levels]; rounding up with probability frac(t) makes E[code] = t.
  at::Tensor t = values.to(at::kDouble).sub(q.lo).div_(span).mul_(levels).clamp_(0, levels);
  at::Tensor codes = t.floor().add_(at::rand({n}, rng, at::kDouble).lt(t - t.floor()).to(at::kDouble))
                         .clamp_(0, levels).to(at::kLong).contiguous();
  const int64_t* c = codes.data_ptr<int64_t>();
  auto* out = reinterpret_cast<unsigned char*>(q.packed.data());
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t code = static_cast<uint64_t>(c[i]);
    for (int64_t b = 0; b < bits; ++b) {
      if (code >> b & 1) {
        const int64_t bit = i * bits + b;
        out[bit >> 3] |= static_cast<unsigned char>(1u << (bit & 7));
      }
    }
  }
  return q;
}

at::Tensor dequantise(const std::string& packed, int64_t count, int64_t bits, float lo, float hi) {
  if (static_cast<int64_t>(packed.size()) != expected_value_bytes(count, bits))
    throw std::runtime_error("quantised values: " + std::to_string(packed.size()) + " bytes for " +
                             std::to_string(count) + " entries of " + std::to_string(bits) + " bits, expected " +
                             std::to_string(expected_value_bytes(count, bits)));
  at::Tensor out = at::empty({count}, at::kFloat);
  float* o = out.data_ptr<float>();
  const auto* in = reinterpret_cast<const unsigned char*>(packed.data());
  const double levels = static_cast<double>((int64_t{1} << bits) - 1);
  const double step = hi > lo ? (static_cast<double>(hi) - lo) / levels : 0.0;
  for (int64_t i = 0; i < count; ++i) {
    uint64_t code = 0;
    for (int64_t b = 0; b < bits; ++b) {
      const int64_t bit = i * bits + b;
      code |= static_cast<uint64_t>(in[bit >> 3] >> (bit & 7) & 1) << b;
    }
    o[i] = static_cast<float>(lo + step * static_cast<double>(code));
  }
  return out;
}

wire::EncodedTensor encode(const at::Tensor& payload, const CompressionSpec& spec, uint64_t seed, uint32_t index,
                           at::Generator& rng) {
  wire::EncodedTensor e;
  e.set_index(index);
  e.set_seed(seed);
  e.set_length(static_cast<uint32_t>(payload.numel()));
  e.set_bits(static_cast<uint32_t>(spec.bits));
  const at::Tensor values = sketch_values(payload, spec, seed);
  if (spec.bits > 0) {
    Quantised q = quantise(values, spec.bits, rng);
    e.set_lo(q.lo);
    e.set_hi(q.hi);
    e.set_values(std::move(q.packed));
  } else {
    e.set_values(values.data_ptr(), static_cast<size_t>(values.numel()) * sizeof(float));
  }
  return e;
}

at::Tensor decode(const wire::EncodedTensor& e, const CompressionSpec& spec, int64_t expected_length) {
  const std::string where = "update tensor " + std::to_string(e.index());
  if (static_cast<int64_t>(e.length()) != expected_length)
    throw std::runtime_error(where + ": payload length " + std::to_string(e.length()) + ", expected " +
                             std::to_string(expected_length));
  if (static_cast<int64_t>(e.bits()) != spec.bits)
    throw std::runtime_error(where + ": " + std::to_string(e.bits()) + " bits, the round asked for " +
                             std::to_string(spec.bits));
  const int64_t kept = kept_entries(spec, e.seed(), expected_length);
  if (static_cast<int64_t>(e.values().size()) != expected_value_bytes(kept, spec.bits))
    throw std::runtime_error(where + ": " + std::to_string(e.values().size()) + " value bytes, expected " +
                             std::to_string(expected_value_bytes(kept, spec.bits)));
  at::Tensor values;
  if (spec.bits > 0) {
    if (!std::isfinite(e.lo()) || !std::isfinite(e.hi()) || e.hi() < e.lo())
      throw std::runtime_error(where + ": bad quantisation range");
    values = dequantise(e.values(), kept, spec.bits, e.lo(), e.hi());
  } else {
    values = at::empty({kept}, at::kFloat);
    std::memcpy(values.data_ptr(), e.values().data(), e.values().size());
    if (!values.isfinite().all().item<bool>()) throw std::runtime_error(where + ": values not finite");
  }
  return unsketch_values(values, spec, e.seed(), expected_length);
}

}  // namespace meshtrain::fl
