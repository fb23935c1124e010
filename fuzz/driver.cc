// libFuzzer entry point of one target (PIPEPLAN_FUZZ_TARGET names the function).
#include "fuzz/targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)pipeplan::fuzz::PIPEPLAN_FUZZ_TARGET(data, size);
  return 0;
}
