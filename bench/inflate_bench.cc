// Microbenchmark: zlib vs libdeflate raw-deflate inflate of 64 KiB qcow2-style
// clusters (window bits -12 as QEMU writes them, stored size padded to the
// sector). Build and run: g++ -O2 -o /tmp/inflate_bench bench/inflate_bench.cc -lz -ldeflate && /tmp/inflate_bench
// Result: bench/results/inflate_bench.txt (the choice of libdeflate for deflate clusters).
#include <libdeflate.h>
#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
int main(int argc, char** argv) {
  const size_t cs = 65536;
  const int n = 4000;
  std::mt19937 rng(1);
  // text-like data: words from a small dictionary + some random bytes
  std::vector<unsigned char> src(cs);
  const char* words[] = {"block ", "storage ", "cluster ", "qcow2 ", "\x00\x00\x00\x00", "engine ", "vblk "};
  size_t p = 0;
  while (p < cs) {
    const char* w = words[rng() % 7];
    size_t l = strlen(w) ? strlen(w) : 4;
    for (size_t i = 0; i < l && p < cs; ++i) src[p++] = (rng() % 16 == 0) ? rng() : w[i];
  }
  std::vector<unsigned char> comp(cs * 2);
  z_stream z{};
  deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, -12, 9, Z_DEFAULT_STRATEGY);
  z.next_in = src.data();
  z.avail_in = cs;
  z.next_out = comp.data();
  z.avail_out = comp.size();
  deflate(&z, Z_FINISH);
  size_t clen = comp.size() - z.avail_out;
  deflateEnd(&z);
  size_t stored = (clen + 511) / 512 * 512;  // padded to sectors like qcow2
  std::vector<unsigned char> out(cs);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    z_stream d{};
    inflateInit2(&d, -12);
    d.next_in = comp.data();
    d.avail_in = stored;
    d.next_out = out.data();
    d.avail_out = cs;
    inflate(&d, Z_FINISH);
    inflateEnd(&d);
  }
  auto t1 = std::chrono::steady_clock::now();
  bool ok1 = memcmp(out.data(), src.data(), cs) == 0;
  memset(out.data(), 0, cs);
  libdeflate_decompressor* dd = libdeflate_alloc_decompressor();
  size_t ain, aout;
  int r = 0;
  for (int i = 0; i < n; ++i)
    r |= libdeflate_deflate_decompress_ex(dd, comp.data(), stored, out.data(), cs, &ain, &aout);
  auto t2 = std::chrono::steady_clock::now();
  bool ok2 = memcmp(out.data(), src.data(), cs) == 0 && r == 0;
  double a = std::chrono::duration<double>(t1 - t0).count(), b = std::chrono::duration<double>(t2 - t1).count();
  printf(
      "cluster 64 KiB, compressed %zu bytes (%.0f %%), %d inflates\nzlib       %.3f s  %.0f MiB/s  ok=%d\nlibdeflate "
      "%.3f s  %.0f MiB/s  ok=%d\nlibdeflate/zlib speedup %.2fx\n",
      clen, 100.0 * clen / cs, n, a, n * 64.0 / 1024 / a, ok1, b, n * 64.0 / 1024 / b, ok2, a / b);
}
