// Chakra execution traces of a plan (MLCommons Chakra's protobuf schema, which ASTRA-sim
// and the Chakra tools read): one file per rank, PREFIX.<rank>.et, each a GlobalMetadata
// message then one Node per op of the rank, in the rank's sequence, every message preceded
// by its length as a varint.
//
// Mapping (a rank's tp x cp GPUs run in lock-step: its file describes each of them):
// - node id = the op's id in the table (unique across the files), name = its string form;
// - compute ops are COMP_NODE with num_ops (FLOPs per GPU), tensor_size (HBM bytes per GPU,
//   memory-bound kernels) and, when durations are given, duration_micros;
// - SEND / RECV are COMM_SEND_NODE / COMM_RECV_NODE with comm_src, comm_dst (ranks),
//   comm_tag (shared by the pair) and comm_size (bytes per GPU);
// - collectives are COMM_COLL_NODE with comm_type, comm_size, pg_name (the group's id) and
//   pg_ranks (its ranks);
// - host copies of saved activations are MEM_STORE_NODE (OFFLOAD) and MEM_LOAD_NODE
//   (RELOAD) with tensor_size (bytes per GPU);
// - data_deps are the op's explicit dependencies on its own rank; a RECV's dependency on
//   its SEND is the (comm_src, comm_tag) match;
// - ctrl_deps are stream order as the simulator and executor run it: a collective follows
//   the rank's previous collective, a host copy the rank's previous copy in its direction;
//   a compute op follows the previous op of the compute
//   stream, or, after a run of consecutive SEND/RECV ops (posted together, sends eager),
//   the run's RECVs and the op before the run; every op of such a run follows the op before it.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "core/table.h"

namespace pipeplan {

std::string ChakraFileName(const std::string& prefix, int32_t rank);

// Writes every rank's file (each atomically). `durations_s` (per op) may be empty.
// Returns the bytes written in all.
StatusOr<size_t> WriteChakraTraces(const Table& t, const std::string& prefix,
                                   const std::vector<double>& durations_s);

}  // namespace pipeplan
