// Replays fuzz inputs without libFuzzer, for any target: linked with one
// fuzz/<name>_fuzz.cc into fuzz_<name>_replay, each file named on the
// command line (or each file in a named directory) goes once through the
// target's entry point. Built by the normal gcc builds so the suite runs the
// seed corpus and the recorded reproducers (fuzz/regressions/<name>/) under
// ASan + UBSan without a clang build; fuzzing itself is scripts/fuzz.sh.
// With `--mutations N`, each input is also replayed N times with a few of
// its first 64 KiB overwritten (a fixed pseudo-random sequence, so a
// failure reproduces): hostile variants of every seed in every build.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

const char* g_name = "fuzz_replay";  // argv[0]'s last component, for messages

uint64_t next(uint64_t& x) {  // xorshift64
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return x;
}

// Overwrites 1 to 8 bytes of the first 64 KiB (for qcow2: header, L1,
// refcount table, first L2 and refcount blocks of a small image; for the
// protocol targets: the handshake and first requests) with random values,
// or with values a parser must bound (0, all ones).
void mutate(std::vector<uint8_t>& d, uint64_t& rng) {
  const size_t area = std::min<size_t>(d.size(), 64 * 1024);
  if (area == 0) return;
  const int n = 1 + static_cast<int>(next(rng) % 8);
  for (int i = 0; i < n; ++i) {
    const size_t at = next(rng) % area;
    switch (next(rng) % 4) {
      case 0: d[at] = 0; break;
      case 1: d[at] = 0xff; break;
      case 2: d[at] = static_cast<uint8_t>(d[at] ^ (1u << (next(rng) % 8))); break;
      default: d[at] = static_cast<uint8_t>(next(rng)); break;
    }
  }
}

int replay(const std::filesystem::path& p, int mutations, int& inputs) {
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "%s: cannot read %s\n", g_name, p.c_str());
    return 1;
  }
  const std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(data.data(), data.size());
  ++inputs;
  uint64_t rng = 0x9E3779B97F4A7C15ull ^ data.size();
  for (int m = 0; m < mutations; ++m) {
    std::vector<uint8_t> v = data;
    mutate(v, rng);
    LLVMFuzzerTestOneInput(v.data(), v.size());
    ++inputs;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int inputs = 0, failed = 0, mutations = 0;
  if (argc > 0) {
    const char* slash = std::strrchr(argv[0], '/');
    g_name = slash ? slash + 1 : argv[0];
  }
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mutations") == 0 && i + 1 < argc) {
      mutations = std::atoi(argv[++i]);
      continue;
    }
    std::filesystem::path p(argv[i]);
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::directory_iterator(p)) {
        if (!e.is_regular_file()) continue;
        failed += replay(e.path(), mutations, inputs);
      }
    } else {
      failed += replay(p, mutations, inputs);
    }
  }
  std::printf("%s: %d input(s) replayed\n", g_name, inputs);
  return failed == 0 && inputs > 0 ? 0 : 1;
}
