// safetensors: every dtype round-trips, and a damaged file is refused with
// its name and what is wrong.
#include "meshtrain/interop/safetensors.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace meshtrain::interop {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("meshtrain-st-" + std::to_string(::getpid()) + "-" + name)).string();
}

TEST(Safetensors, EveryDtypeRoundTripsWithMetadata) {
  const std::string path = temp_path("round.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"f32", at::randn({3, 5})},
      {"bf16", at::randn({7}).to(at::kBFloat16)},
      {"f16", at::randn({2, 2, 2}).to(at::kHalf)},
      {"i64", at::arange(10, at::kLong)},
      {"empty", at::zeros({0, 4})},
      {"scalar", at::tensor(3.5)},
      {"transposed", at::randn({4, 6}).t()}};
  write_safetensors(path, tensors, {{"format", "pt"}});
  SafetensorsFile file(path);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.names().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const at::Tensor back = file.read(name);
    EXPECT_EQ(back.scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(at::equal(back, t)) << name;
  }
  std::remove(path.c_str());
}

TEST(Safetensors, DamagedFilesAreRefusedByName) {
  const std::string path = temp_path("damaged.safetensors");
  write_safetensors(path, {{"w", at::randn({64})}});
  auto error_of = [&] {
    try {
      SafetensorsFile file(path);
      file.read("w");
    } catch (const FormatError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 10);  // truncated
  EXPECT_NE(error_of().find("tensor \"w\": its bytes lie outside the file"), std::string::npos) << error_of();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const uint64_t length = 1000;
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << "{not json";
  }
  EXPECT_NE(error_of().find("does not fit the file"), std::string::npos) << error_of();
  EXPECT_THROW(SafetensorsFile(temp_path("missing")), FormatError);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace meshtrain::interop
