#include "core/chakra.h"

#include <fmt/format.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/util/delimited_message_util.h>

#include <cmath>

#include "chakra_et.pb.h"
#include "core/files.h"
#include "core/version.h"

namespace pipeplan {
namespace {

namespace pb = ChakraProtoMsg;

pb::CollectiveCommType CollType(OpKind k) {
  switch (k) {
    case OpKind::kAllReduce:
      return pb::ALL_REDUCE;
    case OpKind::kReduceScatter:
      return pb::REDUCE_SCATTER;
    case OpKind::kAllGather:
      return pb::ALL_GATHER;
    default:
      return pb::ALL_TO_ALL;
  }
}

pb::AttributeProto* Attr(pb::Node* n, const char* name) {
  auto* a = n->add_attr();
  a->set_name(name);
  return a;
}

// ctrl_deps of op i: stream order (see chakra.h).
void StreamDeps(const Table& t, OpId i, std::vector<OpId>* out) {
  out->clear();
  const OpId begin = t.rank_begin(t.rank(i));
  const Stream s = StreamOf(t.kind(i));
  if (s != Stream::kCompute) {  // the collective or a host copy stream: the op before on it
    for (OpId j = i; j > begin;)
      if (StreamOf(t.kind(--j)) == s) return out->push_back(j);
    return;
  }
  // The compute stream: the op before i, skipping the other streams' ops.
  auto before = [&](OpId x) -> OpId {
    for (OpId j = x; j > begin;)
      if (StreamOf(t.kind(--j)) == Stream::kCompute) return j;
    return UINT32_MAX;
  };
  OpId j = before(i);
  if (IsP2P(t.kind(i))) {  // the op before the run i belongs to
    while (j != UINT32_MAX && IsP2P(t.kind(j))) j = before(j);
    if (j != UINT32_MAX) out->push_back(j);
    return;
  }
  while (j != UINT32_MAX && IsP2P(t.kind(j))) {  // after a run: its RECVs
    if (IsRecv(t.kind(j))) out->push_back(j);
    j = before(j);
  }
  if (j != UINT32_MAX) out->push_back(j);
}

// Appends `m` length-delimited (Chakra's encodeMessage).
void Delimited(std::string* out, const google::protobuf::MessageLite& m) {
  google::protobuf::io::StringOutputStream sink(out);
  google::protobuf::util::SerializeDelimitedToZeroCopyStream(m, &sink);
}

}  // namespace

std::string ChakraFileName(const std::string& prefix, int32_t rank) {
  return fmt::format("{}.{}.et", prefix, rank);
}

StatusOr<size_t> WriteChakraTraces(const Table& t, const std::string& prefix,
                                   const std::vector<double>& durations_s) {
  if (!durations_s.empty() && durations_s.size() != t.size())
    return Internal("chakra: durations do not match the plan's ops");
  size_t total = 0;
  std::vector<OpId> ctrl;
  std::string bytes;
  pb::Node n;
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    const RankInfo& ri = t.ranks()[r];
    bytes.clear();
    pb::GlobalMetadata meta;
    meta.set_version("0.0.4");
    auto meta_attr = [&](const char* name) {
      auto* a = meta.add_attr();
      a->set_name(name);
      return a;
    };
    meta_attr("schema")->set_string_val("1.0.2-chakra.0.0.4");
    meta_attr("generator")->set_string_val(fmt::format("pipeplan {}", kVersion));
    meta_attr("rank")->set_int32_val(r);
    meta_attr("ranks")->set_int32_val(t.num_ranks());
    meta_attr("dp")->set_int32_val(ri.dp);
    meta_attr("pp")->set_int32_val(ri.pp);
    meta_attr("gpus")->set_int32_val(ri.gpus);  // GPUs in lock-step that this file describes
    meta_attr("schedule")->set_string_val(t.meta().schedule);
    meta_attr("modality")->set_string_val(t.meta().modality);
    Delimited(&bytes, meta);
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      n.Clear();
      const OpKind k = t.kind(i);
      const Work& w = t.work(i);
      n.set_id(i);
      n.set_name(t.str(i));
      StreamDeps(t, i, &ctrl);
      for (OpId d : ctrl) n.add_ctrl_deps(d);
      for (OpId d : t.deps(i)) {
        if (t.rank(d) == r)
          n.add_data_deps(d);
        else if (!(IsRecv(k) && IsSend(t.kind(d))))  // the one kind Chakra matches by tag
          return InvalidInput(
              fmt::format("chakra: {} depends on {} of another rank", t.str(i), t.str(d)));
      }
      if (!durations_s.empty())
        n.set_duration_micros(static_cast<uint64_t>(std::llround(durations_s[i] * 1e6)));
      Attr(&n, "is_cpu_op")->set_bool_val(false);
      Attr(&n, "module")->set_string_val(std::string(ModuleName(t.module(i))));
      if (t.mb(i) >= 0) Attr(&n, "microbatch")->set_int32_val(t.mb(i));
      const auto payload = static_cast<int64_t>(std::llround(w.payload_bytes));
      if (IsP2P(k)) {
        const bool send = IsSend(k);
        n.set_type(send ? pb::COMM_SEND_NODE : pb::COMM_RECV_NODE);
        Attr(&n, "comm_src")->set_int32_val(send ? r : t.peer(i));
        Attr(&n, "comm_dst")->set_int32_val(send ? t.peer(i) : r);
        Attr(&n, "comm_tag")->set_int32_val(static_cast<int32_t>(t.tag(i)));
        Attr(&n, "comm_size")->set_int64_val(payload);
      } else if (IsCollective(k)) {
        n.set_type(pb::COMM_COLL_NODE);
        Attr(&n, "comm_type")->set_int64_val(CollType(k));
        Attr(&n, "comm_size")->set_int64_val(payload);
        Attr(&n, "pg_name")->set_string_val(std::to_string(t.peer(i)));
        auto* list = Attr(&n, "pg_ranks")->mutable_int32_list();
        for (int32_t m : t.group(t.peer(i))) list->add_values(m);
      } else if (IsCopy(k)) {  // saved activations to host memory and back
        n.set_type(k == OpKind::kOffload ? pb::MEM_STORE_NODE : pb::MEM_LOAD_NODE);
        Attr(&n, "tensor_size")->set_uint64_val(static_cast<uint64_t>(payload));
      } else {
        n.set_type(pb::COMP_NODE);
        Attr(&n, "num_ops")->set_int64_val(std::llround(w.flops / std::max(1, ri.gpus)));
        Attr(&n, "tensor_size")->set_uint64_val(static_cast<uint64_t>(std::llround(w.hbm_bytes)));
        if (t.grouped(i)) {  // a gang: runs together with the same tag on the group's ranks
          Attr(&n, "gang_group")->set_int32_val(t.peer(i));
          Attr(&n, "gang_tag")->set_int64_val(t.tag(i));
        }
      }
      Delimited(&bytes, n);
    }
    RETURN_IF_ERROR(WriteFileAtomic(ChakraFileName(prefix, r), bytes));
    total += bytes.size();
  }
  return total;
}

}  // namespace pipeplan
