// The gloo backend: Gloo's TCP transport, rendezvous through a file or Redis store.
#pragma once

#include "dist/multiprocess/process_world.h"

namespace funcol::gloo_backend {

// init_process_group("gloo"): rank and world size from options or RANK / WORLD_SIZE, the store
// from options or FUNCOL_STORE (a directory, file:///dir or redis://host:port). The transport
// binds to FUNCOL_GLOO_IFNAME when set, else FUNCOL_GLOO_HOSTNAME, else loopback for a file
// store and the address that routes to the Redis server for a Redis store.
process::ProcessWorld init_world(const InitOptions& options, GroupRegistry& registry);

}  // namespace funcol::gloo_backend
