#pragma once

namespace pipeplan {
inline constexpr const char* kVersion = "0.1.0";
}
