// vblk-vhost-client: drives a vhost-user-blk back end (qemu-storage-daemon,
// later vblk) from the host side, for the interop tests and the benches.
// Every mode prints one JSON document on stdout; see usage() for the modes.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "vhost_user_client.h"
#include "vhost_user_hostile.h"

using json = nlohmann::ordered_json;
using namespace vhu;

namespace {

const char kUsage[] = R"(usage: vblk-vhost-client MODE SOCKET [options] [args]

modes:
  info SOCKET                 negotiate, print features, protocol features,
                              queue count, config space, inflight size
  io SOCKET [SCRIPT...]       run a request script (arguments, or stdin when
                              none); commands separated by newlines or ';':
                                write OFF LEN PATTERN
                                read OFF LEN [expect PATTERN] [save FILE]
                                flush | getid | discard OFF LEN
                                zero OFF LEN [unmap]
                                raw TYPE [in LEN | out LEN] [sector S]
                                wait          (all earlier requests complete)
                                wce 0|1       (SET_CONFIG of the wce byte)
                                config        (GET_CONFIG now)
                                stop          (GET_VRING_BASE on every queue)
                                kick          (publish what was added, kick)
                                publish       (publish it, never kick)
                                sleep MS      (neither kick nor reap)
                              a command may start with @Q to pick queue Q;
                              PATTERN is a byte (0xab, 171) or rand:SEED
  verify SOCKET               write a pattern over a range, read it back and
                              check it: --offset O --size S --bs B --seed N
                              [--phase write|read|both]
  bench SOCKET                --rw randread|randwrite|read|write --bs B
                              --qd N (per queue) --seconds S [--size BYTES]
                              [--daemon-pid PID] [--offset O]
  hostile SOCKET KIND|all     malformed rings or messages; prints what the
                              back end did (reply / no_reply / disconnect)
                              and whether the export serves a new client;
                              KIND list: hostile SOCKET list

options (all modes):
  --queues N          queues to set up (1)       --queue-size N      (128)
  --event-idx on|off|auto   --indirect on|off|auto   --reply-ack on|off|auto
  --inflight on|off|auto    (GET/SET_INFLIGHT_FD)
  --mem-regions N     memory table regions, 1-8 (2)
  --mem-size BYTES    guest memory (64M; bench: enough for its buffers)
  --max-seg BYTES     split data buffers into descriptors of at most BYTES,
                      taken from alternating regions
  --qd N              requests in flight (io, verify: in all; bench: per queue)
  --timeout S         seconds to wait for a reply or a completion (10)
  --reconnect S       on a dropped socket, reconnect for up to S seconds,
                      pass the inflight fd back and go on (io, verify)
  --verbose           log every vhost-user message on stderr
sizes take k, M, G suffixes (powers of 1024).
exit: 0 done and every request OK, 1 a request failed or data differed,
      2 usage, 3 protocol error, disconnect or timeout.
)";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "vblk-vhost-client: %s\nTry 'vblk-vhost-client --help'.\n", msg.c_str());
  std::exit(2);
}

uint64_t parse_size(const std::string& s) {
  if (s.empty()) usage_error("empty size");
  size_t pos = 0;
  uint64_t v;
  try {
    v = std::stoull(s, &pos, 0);
  } catch (...) {
    usage_error("bad number '" + s + "'");
  }
  std::string suf = s.substr(pos);
  if (suf.empty() || suf == "b" || suf == "B") return v;
  char c = static_cast<char>(std::tolower(suf[0]));
  if (suf.size() > 1 && !(suf.size() == 3 && suf.substr(1) == "iB") && suf.substr(1) != "b" && suf.substr(1) != "B")
    usage_error("bad size '" + s + "'");
  switch (c) {
    case 'k': return v << 10;
    case 'm': return v << 20;
    case 'g': return v << 30;
    case 't': return v << 40;
  }
  usage_error("bad size '" + s + "'");
}

Toggle parse_toggle(const std::string& s) {
  if (s == "on" || s == "1") return Toggle::kOn;
  if (s == "off" || s == "0") return Toggle::kOff;
  if (s == "auto") return Toggle::kAuto;
  usage_error("expected on, off or auto, not '" + s + "'");
}

std::string hex64(uint64_t v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
}

std::string hexbits(uint64_t v) {
  char b[32];
  std::snprintf(b, sizeof(b), "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

struct Args {
  std::string mode, socket;
  std::vector<std::string> rest;
  Options opts;
  unsigned qd = 0;
  double reconnect_s = 0;
  // verify / bench
  uint64_t offset = 0, size = 0, bs = 4096;
  uint64_t seed = 1;
  std::string phase = "both", rw = "randread";
  double seconds = 5;
  long daemon_pid = 0;
  bool mem_size_given = false;
};

Args parse_args(int argc, char** argv) {
  Args a;
  std::vector<std::string> pos;
  for (int i = 1; i < argc; i++) {
    std::string s = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage_error("option " + s + " needs a value");
      return argv[++i];
    };
    if (s == "-h" || s == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (s == "--queues") {
      a.opts.queues = static_cast<unsigned>(parse_size(val()));
    } else if (s == "--queue-size") {
      uint64_t n = parse_size(val());
      if (n == 0 || n > 32768 || (n & (n - 1))) usage_error("--queue-size: a power of two up to 32768");
      a.opts.queue_size = static_cast<uint16_t>(n);
    } else if (s == "--event-idx") {
      a.opts.event_idx = parse_toggle(val());
    } else if (s == "--indirect") {
      a.opts.indirect = parse_toggle(val());
    } else if (s == "--reply-ack") {
      a.opts.reply_ack = parse_toggle(val());
    } else if (s == "--inflight") {
      a.opts.inflight = parse_toggle(val());
    } else if (s == "--mem-regions") {
      a.opts.mem_regions = static_cast<int>(parse_size(val()));
      if (a.opts.mem_regions < 1 || a.opts.mem_regions > 8) usage_error("--mem-regions: 1 to 8");
    } else if (s == "--mem-size") {
      a.opts.mem_bytes = parse_size(val());
      a.mem_size_given = true;
    } else if (s == "--max-seg") {
      a.opts.max_seg = static_cast<uint32_t>(parse_size(val()));
    } else if (s == "--qd") {
      a.qd = static_cast<unsigned>(parse_size(val()));
      if (a.qd == 0) usage_error("--qd: at least 1");
    } else if (s == "--timeout") {
      a.opts.reply_timeout_ms = static_cast<int>(std::stod(val()) * 1000);
    } else if (s == "--connect-timeout") {
      a.opts.connect_timeout_ms = static_cast<int>(std::stod(val()) * 1000);
    } else if (s == "--reconnect") {
      a.reconnect_s = std::stod(val());
    } else if (s == "--verbose") {
      a.opts.verbose = true;
    } else if (s == "--offset") {
      a.offset = parse_size(val());
    } else if (s == "--size") {
      a.size = parse_size(val());
    } else if (s == "--bs") {
      a.bs = parse_size(val());
    } else if (s == "--seed") {
      a.seed = parse_size(val());
    } else if (s == "--phase") {
      a.phase = val();
    } else if (s == "--rw") {
      a.rw = val();
    } else if (s == "--seconds") {
      a.seconds = std::stod(val());
    } else if (s == "--daemon-pid") {
      a.daemon_pid = std::stol(val());
    } else if (s.size() > 1 && s[0] == '-' && s.substr(0, 2) == "--") {
      usage_error("unknown option " + s);
    } else {
      pos.push_back(s);
    }
  }
  if (pos.empty()) usage_error("no mode given");
  a.mode = pos[0];
  if (pos.size() < 2) usage_error("no socket given");
  a.socket = pos[1];
  a.rest.assign(pos.begin() + 2, pos.end());
  if (a.opts.queues < 1) usage_error("--queues: at least 1");
  return a;
}

json config_json(const BlkConfig& c) {
  return json{{"capacity", c.capacity},
              {"size_max", c.size_max},
              {"seg_max", c.seg_max},
              {"geometry", {{"cylinders", c.cylinders}, {"heads", c.heads}, {"sectors", c.sectors}}},
              {"blk_size", c.blk_size},
              {"physical_block_exp", c.physical_block_exp},
              {"alignment_offset", c.alignment_offset},
              {"min_io_size", c.min_io_size},
              {"opt_io_size", c.opt_io_size},
              {"wce", c.wce},
              {"num_queues", c.num_queues},
              {"max_discard_sectors", c.max_discard_sectors},
              {"max_discard_seg", c.max_discard_seg},
              {"discard_sector_alignment", c.discard_sector_alignment},
              {"max_write_zeroes_sectors", c.max_write_zeroes_sectors},
              {"max_write_zeroes_seg", c.max_write_zeroes_seg},
              {"write_zeroes_may_unmap", c.write_zeroes_may_unmap}};
}

json negotiation_json(Device& d) {
  json j;
  j["features"] = hexbits(d.features_offered());
  j["feature_names"] = feature_names(d.features_offered());
  j["features_acked"] = hexbits(d.features_acked());
  j["feature_names_acked"] = feature_names(d.features_acked());
  j["protocol_features"] = hexbits(d.protocol_offered());
  j["protocol_feature_names"] = protocol_feature_names(d.protocol_offered());
  j["protocol_features_acked"] = hexbits(d.protocol_acked());
  j["protocol_feature_names_acked"] = protocol_feature_names(d.protocol_acked());
  j["queue_num"] = d.queue_num();
  j["queues"] = d.nqueues();
  j["queue_size"] = d.options().queue_size;
  j["event_idx"] = d.has(kFEventIdx);
  j["indirect"] = d.has(kFIndirectDesc);
  j["mem_regions"] = d.mem().regions().size();
  j["inflight_mmap_size"] = d.inflight_mmap_size();
  return j;
}

// ---------------------------------------------------------------------------
// io / verify: ops run with a bounded number in flight
// ---------------------------------------------------------------------------

struct Pattern {
  bool random = false;
  uint64_t seed = 0;
  uint8_t byte = 0;
  void fill(uint8_t* p, uint64_t off, size_t len) const {
    if (random)
      fill_pattern(p, off, len, seed);
    else
      std::memset(p, byte, len);
  }
  int64_t check(const uint8_t* p, uint64_t off, size_t len) const {
    if (random) return check_pattern(p, off, len, seed);
    for (size_t i = 0; i < len; i++)
      if (p[i] != byte) return static_cast<int64_t>(off + i);
    return -1;
  }
  std::string text() const { return random ? "rand:" + std::to_string(seed) : std::to_string(byte); }
};

Pattern parse_pattern(const std::string& s) {
  Pattern p;
  if (s.rfind("rand:", 0) == 0) {
    p.random = true;
    p.seed = std::stoull(s.substr(5), nullptr, 0);
  } else {
    uint64_t v = std::stoull(s, nullptr, 0);
    if (v > 255) usage_error("pattern byte out of range: " + s);
    p.byte = static_cast<uint8_t>(v);
  }
  return p;
}

struct Op {
  enum Kind {
    kWrite,
    kRead,
    kFlush,
    kDiscard,
    kZero,
    kGetId,
    kRaw,
    kWait,
    kWce,
    kConfig,
    kStop,
    kKick,
    kPublish,
    kSleep
  } kind;
  std::string text;
  uint64_t off = 0, len = 0;
  Pattern pat;
  bool expect = false;
  std::string save;
  bool unmap = false;
  uint32_t raw_type = 0;
  int raw_dir = 0;  // 0 no data, 1 device writes (in), 2 device reads (out)
  int queue = -1;
  uint8_t wce = 0;
  bool quiet = false;  // verify: summarised, not listed
};

std::vector<std::string> split_words(const std::string& s) {
  std::istringstream is(s);
  std::vector<std::string> w;
  std::string t;
  while (is >> t) w.push_back(t);
  return w;
}

std::vector<Op> parse_script(const std::string& text) {
  std::vector<Op> ops;
  std::string cur;
  std::vector<std::string> cmds;
  for (char c : text) {
    if (c == '\n' || c == ';') {
      cmds.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  cmds.push_back(cur);
  for (std::string& c : cmds) {
    auto hash = c.find('#');
    if (hash != std::string::npos) c.resize(hash);
    auto w = split_words(c);
    if (w.empty()) continue;
    Op op{};
    op.text = c.substr(c.find_first_not_of(" \t"));
    if (w[0][0] == '@') {
      op.queue = std::stoi(w[0].substr(1));
      w.erase(w.begin());
      if (w.empty()) usage_error("script: '" + c + "': no command");
    }
    auto need = [&](size_t n) {
      if (w.size() < n) usage_error("script: '" + c + "': too few arguments");
    };
    const std::string& k = w[0];
    if (k == "write") {
      need(4);
      op.kind = Op::kWrite;
      op.off = parse_size(w[1]);
      op.len = parse_size(w[2]);
      op.pat = parse_pattern(w[3]);
    } else if (k == "read") {
      need(3);
      op.kind = Op::kRead;
      op.off = parse_size(w[1]);
      op.len = parse_size(w[2]);
      for (size_t i = 3; i < w.size(); i++) {
        if (w[i] == "expect" && i + 1 < w.size()) {
          op.expect = true;
          op.pat = parse_pattern(w[++i]);
        } else if (w[i] == "save" && i + 1 < w.size()) {
          op.save = w[++i];
        } else {
          usage_error("script: '" + c + "': unknown '" + w[i] + "'");
        }
      }
    } else if (k == "flush") {
      op.kind = Op::kFlush;
    } else if (k == "getid") {
      op.kind = Op::kGetId;
    } else if (k == "discard" || k == "zero") {
      need(3);
      op.kind = k == "discard" ? Op::kDiscard : Op::kZero;
      op.off = parse_size(w[1]);
      op.len = parse_size(w[2]);
      op.unmap = w.size() > 3 && w[3] == "unmap";
    } else if (k == "raw") {
      need(2);
      op.kind = Op::kRaw;
      op.raw_type = static_cast<uint32_t>(std::stoul(w[1], nullptr, 0));
      for (size_t i = 2; i + 1 < w.size(); i += 2) {
        if (w[i] == "in") {
          op.raw_dir = 1;
          op.len = parse_size(w[i + 1]);
        } else if (w[i] == "out") {
          op.raw_dir = 2;
          op.len = parse_size(w[i + 1]);
        } else if (w[i] == "sector") {
          op.off = parse_size(w[i + 1]) * 512;
        } else {
          usage_error("script: '" + c + "': unknown '" + w[i] + "'");
        }
      }
    } else if (k == "wait") {
      op.kind = Op::kWait;
    } else if (k == "wce") {
      need(2);
      op.kind = Op::kWce;
      op.wce = static_cast<uint8_t>(std::stoul(w[1]));
    } else if (k == "config") {
      op.kind = Op::kConfig;
    } else if (k == "stop") {
      op.kind = Op::kStop;
    } else if (k == "kick") {
      op.kind = Op::kKick;
    } else if (k == "publish") {
      op.kind = Op::kPublish;
    } else if (k == "sleep") {
      need(2);
      op.kind = Op::kSleep;
      op.len = parse_size(w[1]);
    } else {
      usage_error("script: unknown command '" + k + "'");
    }
    if ((op.kind == Op::kWrite || op.kind == Op::kRead || op.kind == Op::kDiscard || op.kind == Op::kZero) &&
        op.off % 512)
      usage_error("script: '" + c + "': offset not a multiple of 512");
    ops.push_back(op);
  }
  return ops;
}

struct Runner {
  Device& dev;
  unsigned qd;
  double reconnect_s;
  json results = json::array();
  unsigned reconnects = 0;
  size_t resubmitted = 0;
  size_t not_ok = 0, mismatches = 0;
  int64_t first_mismatch = -1;
  uint64_t bytes_written = 0, bytes_read = 0;
  unsigned next_queue = 0;
  struct Live {
    size_t op;
    unsigned queue;
    GuestMemory::Block buf;
  };
  std::vector<Live> live;  // indexed by token
  std::vector<size_t> free_tokens;
  const std::vector<Op>* ops = nullptr;
  std::vector<json> per_op;

  Runner(Device& d, unsigned q, double r) : dev(d), qd(q), reconnect_s(r) {}

  // Waits for completions (blocking when `block`), reconnecting if allowed.
  void pump(bool block) {
    for (;;) {
      try {
        if (block && !dev.wait(dev.options().reply_timeout_ms))
          throw Timeout("no completion within " + std::to_string(dev.options().reply_timeout_ms) + " ms (" +
                        std::to_string(dev.in_flight()) + " in flight)");
        std::vector<Completion> comps;
        dev.reap(comps);
        for (auto& c : comps) complete(c);
        return;
      } catch (const Disconnected& e) {
        if (reconnect_s <= 0) throw;
        std::fprintf(stderr, "vblk-vhost-client: %s; reconnecting\n", e.what());
        resubmitted += dev.reconnect(reconnect_s);
        reconnects++;
      }
    }
  }

  void complete(const Completion& c) {
    Live l = live[c.token];
    free_tokens.push_back(c.token);
    const Op& op = (*ops)[l.op];
    json& r = per_op[l.op];
    r["status"] = status_name(c.status);
    r["status_code"] = c.status;
    r["used_len"] = c.used_len;
    if (c.status != kBlkOk) not_ok++;
    if (op.kind == Op::kWrite && c.status == kBlkOk) bytes_written += op.len;
    if (op.kind == Op::kRead && l.buf.host) {
      if (c.status == kBlkOk) bytes_read += op.len;
      r["fnv1a64"] = hex64(fnv1a64(l.buf.host, op.len));
      if (op.expect) {
        int64_t at = op.pat.check(l.buf.host, op.off, op.len);
        r["match"] = at < 0;
        if (at >= 0) {
          r["mismatch_at"] = at;
          mismatches++;
          if (first_mismatch < 0 || at < first_mismatch) first_mismatch = at;
        }
      }
      if (!op.save.empty()) {
        std::ofstream f(op.save, std::ios::binary);
        f.write(reinterpret_cast<const char*>(l.buf.host), static_cast<std::streamsize>(op.len));
      }
    }
    if (op.kind == Op::kGetId && l.buf.host) {
      std::string id(reinterpret_cast<const char*>(l.buf.host), kBlkIdBytes);
      id.resize(std::strlen(id.c_str()));
      r["id"] = id;
    }
    if (op.kind == Op::kRaw && op.raw_dir == 1 && l.buf.host) r["fnv1a64"] = hex64(fnv1a64(l.buf.host, op.len));
    if (l.buf.host) dev.mem().free(l.buf);
  }

  void drain() {
    while (dev.in_flight()) pump(true);
  }

  void submit(size_t i, const Op& op) {
    BlkRequest req;
    GuestMemory::Block buf;
    GuestMemory::Block range;
    req.sector = op.off / 512;
    switch (op.kind) {
      case Op::kWrite:
        req.type = kBlkOut;
        if (op.len) {  // no data descriptor for 0 bytes
          buf = dev.mem().alloc(op.len, 4096);
          op.pat.fill(buf.host, op.off, op.len);
          req.data = dev.segs(buf, false);
        }
        break;
      case Op::kRead:
        req.type = kBlkIn;
        if (op.len) {
          buf = dev.mem().alloc(op.len, 4096);
          std::memset(buf.host, 0xa5, op.len);
          req.data = dev.segs(buf, true);
        }
        break;
      case Op::kFlush: req.type = kBlkFlush; break;
      case Op::kGetId:
        req.type = kBlkGetId;
        buf = dev.mem().alloc(kBlkIdBytes, 64);
        std::memset(buf.host, 0, kBlkIdBytes);
        req.data = dev.segs(buf, true);
        break;
      case Op::kDiscard:
      case Op::kZero: {
        req.type = op.kind == Op::kDiscard ? kBlkDiscard : kBlkWriteZeroes;
        req.sector = 0;
        buf = dev.mem().alloc(16, 64);
        uint64_t sector = op.off / 512;
        uint32_t num = static_cast<uint32_t>(op.len / 512), flags = op.unmap ? kBlkDiscardUnmap : 0;
        std::memcpy(buf.host, &sector, 8);
        std::memcpy(buf.host + 8, &num, 4);
        std::memcpy(buf.host + 12, &flags, 4);
        req.data = dev.segs(buf, false);
        break;
      }
      case Op::kRaw:
        req.type = op.raw_type;
        if (op.raw_dir) {
          buf = dev.mem().alloc(op.len, 4096);
          std::memset(buf.host, 0, op.len);
          req.data = dev.segs(buf, op.raw_dir == 1);
        }
        break;
      default: return;
    }
    unsigned q = op.queue >= 0 ? static_cast<unsigned>(op.queue) % dev.nqueues() : next_queue++ % dev.nqueues();
    size_t token;
    if (!free_tokens.empty()) {
      token = free_tokens.back();
      free_tokens.pop_back();
    } else {
      token = live.size();
      live.push_back({});
    }
    live[token] = Live{i, q, buf};
    while (!dev.submit(q, req, token)) {
      dev.kick(q);
      pump(true);
    }
    json& r = per_op[i];
    r["queue"] = q;
  }

  void run(const std::vector<Op>& list) {
    ops = &list;
    per_op.assign(list.size(), json::object());
    for (size_t i = 0; i < list.size(); i++) {
      const Op& op = list[i];
      json& r = per_op[i];
      r["cmd"] = op.text;
      switch (op.kind) {
        case Op::kWait:
          dev.kick_all();
          drain();
          continue;
        case Op::kWce: {
          dev.kick_all();
          drain();
          uint64_t ack = dev.set_config(kBlkConfigWceOffset, std::span<const uint8_t>(&op.wce, 1));
          r["ack"] = ack;
          r["wce"] = BlkConfig::parse(dev.get_config(0, kBlkConfigSize)).wce;
          continue;
        }
        case Op::kConfig: r["config"] = config_json(BlkConfig::parse(dev.get_config(0, kBlkConfigSize))); continue;
        case Op::kStop: {
          dev.kick_all();
          drain();
          r["vring_bases"] = dev.stop();
          continue;
        }
        case Op::kKick: dev.kick_all(); continue;
        case Op::kPublish: dev.publish_all_silently(); continue;
        case Op::kSleep: std::this_thread::sleep_for(std::chrono::milliseconds(op.len)); continue;
        default: break;
      }
      while (dev.in_flight() >= qd) {
        dev.kick_all();
        pump(true);
      }
      submit(i, op);
      if (dev.in_flight() >= qd || i + 1 == list.size()) dev.kick_all();
      pump(false);
    }
    dev.kick_all();
    drain();
    for (size_t i = 0; i < list.size(); i++)
      if (!list[i].quiet) results.push_back(per_op[i]);
  }
};

int report(json& out, int rc) {
  std::cout << out.dump(2) << std::endl;
  return rc;
}

int cmd_info(const Args& a) {
  Device d(a.opts);
  json out;
  try {
    d.connect(a.socket);
    out = negotiation_json(d);
    out["config"] = config_json(d.config());
    std::vector<uint8_t> raw = d.config_bytes();
    std::string hx;
    for (uint8_t b : raw) {
      char t[4];
      std::snprintf(t, sizeof(t), "%02x", b);
      hx += t;
    }
    out["config_hex"] = hx;
    if (d.has_protocol(kPfMq)) out["queue_num"] = d.queue_num();
  } catch (const ProtocolError& e) {
    out["error"] = e.what();
    return report(out, 3);
  }
  return report(out, 0);
}

int cmd_io(const Args& a) {
  std::string text;
  if (a.rest.empty()) {
    std::stringstream ss;
    ss << std::cin.rdbuf();
    text = ss.str();
  } else {
    for (auto& s : a.rest) text += s + "\n";
  }
  std::vector<Op> ops = parse_script(text);
  Device d(a.opts);
  Runner r(d, a.qd ? a.qd : 1, a.reconnect_s);
  json out;
  int rc = 0;
  try {
    d.connect(a.socket);
    out = negotiation_json(d);
    r.run(ops);
  } catch (const ProtocolError& e) {
    out["error"] = e.what();
    rc = 3;
  }
  for (size_t i = 0; i < r.per_op.size() && rc == 3; i++)
    if (!r.per_op[i].contains("status") && r.per_op[i].contains("queue")) r.per_op[i]["status"] = "none";
  out["results"] = rc == 3 ? json(r.per_op) : r.results;
  out["reconnects"] = r.reconnects;
  out["resubmitted"] = r.resubmitted;
  out["not_ok"] = r.not_ok;
  out["mismatches"] = r.mismatches;
  if (rc == 0 && (r.not_ok || r.mismatches)) rc = 1;
  return report(out, rc);
}

int cmd_verify(const Args& a) {
  if (!a.size || a.bs == 0 || a.bs % 512 || a.offset % 512) usage_error("verify: --size, --bs (multiple of 512)");
  std::vector<Op> ops;
  Pattern pat;
  pat.random = true;
  pat.seed = a.seed;
  auto add = [&](Op::Kind k) {
    for (uint64_t o = a.offset; o < a.offset + a.size; o += a.bs) {
      Op op{};
      op.kind = k;
      op.off = o;
      op.len = std::min(a.bs, a.offset + a.size - o);
      op.pat = pat;
      op.expect = k == Op::kRead;
      op.quiet = true;
      op.text = k == Op::kRead ? "read" : "write";
      ops.push_back(op);
    }
  };
  if (a.phase == "write" || a.phase == "both") add(Op::kWrite);
  if (a.phase == "both") {
    Op w{};
    w.kind = Op::kWait;
    w.quiet = true;
    ops.push_back(w);
    Op f{};
    f.kind = Op::kFlush;
    f.quiet = true;
    f.text = "flush";
    ops.push_back(f);
    ops.push_back(w);
  }
  if (a.phase == "read" || a.phase == "both") add(Op::kRead);
  if (a.phase != "write" && a.phase != "read" && a.phase != "both") usage_error("--phase: write, read or both");
  Options o = a.opts;
  if (!a.mem_size_given) o.mem_bytes = std::max<uint64_t>(64ull << 20, 4 * a.bs * (a.qd ? a.qd : 32));
  Device d(o);
  Runner r(d, a.qd ? a.qd : 32, a.reconnect_s);
  json out;
  int rc = 0;
  auto t0 = std::chrono::steady_clock::now();
  try {
    d.connect(a.socket);
    out = negotiation_json(d);
    r.run(ops);
  } catch (const ProtocolError& e) {
    out["error"] = e.what();
    rc = 3;
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out["offset"] = a.offset;
  out["size"] = a.size;
  out["bs"] = a.bs;
  out["seed"] = a.seed;
  out["phase"] = a.phase;
  out["bytes_written"] = r.bytes_written;
  out["bytes_read"] = r.bytes_read;
  out["not_ok"] = r.not_ok;
  out["mismatches"] = r.mismatches;
  out["first_mismatch"] = r.first_mismatch;
  out["reconnects"] = r.reconnects;
  out["resubmitted"] = r.resubmitted;
  out["seconds"] = secs;
  if (rc == 0 && (r.not_ok || r.mismatches)) rc = 1;
  return report(out, rc);
}

// ---------------------------------------------------------------------------
// bench
// ---------------------------------------------------------------------------

bool proc_cpu_ticks(long pid, uint64_t& ticks) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto rp = s.rfind(')');
  if (rp == std::string::npos) return false;
  std::istringstream is(s.substr(rp + 2));
  std::vector<std::string> fld;
  std::string t;
  while (is >> t) fld.push_back(t);
  // fields after the comm: state(3) ... utime is field 14, stime 15 (1-based)
  if (fld.size() < 13) return false;
  ticks = std::stoull(fld[11]) + std::stoull(fld[12]);
  return true;
}

double self_cpu_s() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

int cmd_bench(const Args& a) {
  bool rnd = a.rw == "randread" || a.rw == "randwrite";
  bool wr = a.rw == "randwrite" || a.rw == "write";
  if (!rnd && a.rw != "read" && a.rw != "write") usage_error("--rw: randread, randwrite, read or write");
  if (a.bs == 0 || a.bs % 512) usage_error("--bs: a multiple of 512");
  unsigned qd = a.qd ? a.qd : 1;
  Options o = a.opts;
  if (o.queue_size < qd) usage_error("--qd larger than --queue-size");
  if (!a.mem_size_given) o.mem_bytes = std::max<uint64_t>(32ull << 20, a.bs * qd * o.queues + (16ull << 20));
  Device d(o);
  json out;
  try {
    d.connect(a.socket);
  } catch (const ProtocolError& e) {
    out["error"] = e.what();
    return report(out, 3);
  }
  uint64_t disk = d.config().capacity * 512;
  uint64_t size = a.size ? std::min(a.size, disk - a.offset) : disk - a.offset;
  if (size < a.bs) usage_error("bench: range smaller than --bs");
  uint64_t blocks = size / a.bs;
  struct Slot {
    GuestMemory::Block buf;
    std::chrono::steady_clock::time_point t;
  };
  unsigned nq = d.nqueues();
  std::vector<Slot> slots(static_cast<size_t>(qd) * nq);
  for (auto& s : slots) {
    s.buf = d.mem().alloc(a.bs, 4096);
    if (wr)
      fill_pattern(s.buf.host, 0, a.bs, a.seed);
    else
      std::memset(s.buf.host, 0, a.bs);
  }
  std::mt19937_64 rng(a.seed);
  std::vector<uint64_t> seq_next(nq);
  for (unsigned q = 0; q < nq; q++) seq_next[q] = blocks * q / nq;
  auto issue = [&](size_t tok) {
    unsigned q = static_cast<unsigned>(tok / qd);
    uint64_t blk = rnd ? rng() % blocks : seq_next[q]++ % blocks;
    BlkRequest req;
    req.type = wr ? kBlkOut : kBlkIn;
    req.sector = (a.offset + blk * a.bs) / 512;
    req.data = d.segs(slots[tok].buf, !wr);
    slots[tok].t = std::chrono::steady_clock::now();
    if (!d.submit(q, req, tok)) throw ProtocolError("bench: ring full");
  };
  uint64_t t0_ticks = 0, t1_ticks = 0;
  bool have_pid = a.daemon_pid > 0 && proc_cpu_ticks(a.daemon_pid, t0_ticks);
  double c0 = self_cpu_s();
  auto start = std::chrono::steady_clock::now();
  auto end =
      start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(a.seconds));
  uint64_t ops = 0, errors = 0;
  std::vector<float> lat;
  lat.reserve(1 << 20);
  std::vector<Completion> comps;
  try {
    for (size_t t = 0; t < slots.size(); t++) issue(t);
    d.kick_all();
    bool stopping = false;
    while (d.in_flight()) {
      if (!d.wait(d.options().reply_timeout_ms)) throw Timeout("bench: no completion");
      comps.clear();
      d.reap(comps);
      auto now = std::chrono::steady_clock::now();
      if (now >= end) stopping = true;
      for (auto& c : comps) {
        if (c.status != kBlkOk) errors++;
        ops++;
        lat.push_back(std::chrono::duration<float, std::micro>(now - slots[c.token].t).count());
        if (!stopping) issue(c.token);
      }
      d.kick_all();
    }
  } catch (const ProtocolError& e) {
    out["error"] = e.what();
    return report(out, 3);
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double c1 = self_cpu_s();
  if (have_pid) have_pid = proc_cpu_ticks(a.daemon_pid, t1_ticks);
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double p) -> double {
    if (lat.empty()) return 0;
    return lat[std::min(lat.size() - 1, static_cast<size_t>(p * static_cast<double>(lat.size())))];
  };
  double mean = 0;
  for (float v : lat) mean += v;
  if (!lat.empty()) mean /= static_cast<double>(lat.size());
  out = negotiation_json(d);
  out["rw"] = a.rw;
  out["bs"] = a.bs;
  out["qd_per_queue"] = qd;
  out["queues_used"] = nq;
  out["range"] = size;
  out["seconds"] = secs;
  out["ops"] = ops;
  out["errors"] = errors;
  out["iops"] = static_cast<double>(ops) / secs;
  out["mib_s"] = static_cast<double>(ops) * static_cast<double>(a.bs) / secs / (1 << 20);
  out["lat_us_mean"] = mean;
  out["lat_us_p50"] = pct(0.5);
  out["lat_us_p99"] = pct(0.99);
  out["client_cpu_us_per_op"] = ops ? (c1 - c0) * 1e6 / static_cast<double>(ops) : 0.0;
  uint64_t kicks = 0, calls = 0;
  for (unsigned q = 0; q < nq; q++) {
    kicks += d.queue(q).kicks();
    calls += d.queue(q).calls_seen();
  }
  out["kicks"] = kicks;
  out["calls"] = calls;
  if (have_pid) {
    double cpu = static_cast<double>(t1_ticks - t0_ticks) / static_cast<double>(sysconf(_SC_CLK_TCK));
    out["daemon_pid"] = a.daemon_pid;
    out["daemon_cpu_s"] = cpu;
    out["daemon_cpu_us_per_op"] = ops ? cpu * 1e6 / static_cast<double>(ops) : 0.0;
  }
  return report(out, errors ? 1 : 0);
}

int cmd_hostile(const Args& a) {
  if (a.rest.empty()) usage_error("hostile: which KIND (or all, or list)?");
  std::string kind = a.rest[0];
  if (kind == "list") {
    json out = json::array();
    for (const auto& k : hostile_kinds()) out.push_back({{"kind", k.name}, {"what", k.what}});
    return report(out, 0);
  }
  std::vector<std::string> kinds;
  if (kind == "all") {
    for (const auto& k : hostile_kinds()) kinds.push_back(k.name);
  } else {
    kinds.push_back(kind);
  }
  Options o = a.opts;
  json out = json::array();
  for (const auto& k : kinds) {
    bool known = false;
    for (const auto& hk : hostile_kinds()) known |= hk.name == k;
    if (!known) usage_error("hostile: unknown kind '" + k + "' (hostile SOCKET list)");
    out.push_back(run_hostile(a.socket, k, o, a.opts.reply_timeout_ms));
  }
  return report(kind == "all" ? out : out[0], 0);
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  Args a = parse_args(argc, argv);
  try {
    if (a.mode == "info") return cmd_info(a);
    if (a.mode == "io") return cmd_io(a);
    if (a.mode == "verify") return cmd_verify(a);
    if (a.mode == "bench") return cmd_bench(a);
    if (a.mode == "hostile") return cmd_hostile(a);
  } catch (const std::bad_alloc&) {
    json out{{"error", "guest memory exhausted (--mem-size)"}};
    return report(out, 3);
  } catch (const std::exception& e) {
    json out{{"error", e.what()}};
    return report(out, 3);
  }
  usage_error("unknown mode '" + a.mode + "'");
}
