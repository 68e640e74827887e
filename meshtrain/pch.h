// Precompiled header shared by every meshtrain target: the libtorch headers
// dominate compile time on small machines.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
