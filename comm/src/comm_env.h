// Settings the communication layer reads from the environment, all parsed in comm_env.cpp (the
// one place), and small process facts (host name) the backends share.
#pragma once

#include <string>

namespace zero8::comm::detail {

double env_comm_timeout();        // ZERO8_COMM_TIMEOUT: seconds, > 0 (default 600)
int env_comm_link_timeout();      // ZERO8_COMM_LINK_TIMEOUT: whole seconds, 2..32767 (default 60)
std::string env_comm_ifaddr();    // ZERO8_COMM_IFADDR: IPv4 address for liveness sockets ("" = unset)
std::string env_comm_node();      // ZERO8_COMM_NODE: node name for node groups (default: hostname)
std::string host_name();          // gethostname()

}  // namespace zero8::comm::detail
