// TCP plumbing shared by the liveness mesh (liveness.cpp) and the tcp backend (comm_tcp.cpp): where a
// rank listens, connecting with a deadline, the keepalive settings that turn a network partition into
// an error after ZERO8_COMM_LINK_TIMEOUT seconds, and reads and writes bounded by a deadline.
#pragma once

#include <netinet/in.h>
#include <sys/types.h>

#include <cstdint>
#include <string>

namespace zero8::comm::detail {

// Seconds on the steady clock: the time base of every deadline below.
double socket_now();

// A listening IPv4 socket (SOCK_CLOEXEC) on ZERO8_COMM_IFADDR's address (`ifaddr`), else the address the
// hostname resolves to, falling back to loopback when this host (container) does not have that address,
// else loopback; any free port. Returns the fd with *address = "ip:port" and *bound its address, or -1
// with *error saying why (the caller decides when to raise it: peers waiting for this rank should learn
// of it too). Throws Error(invalid_argument) for an ifaddr that is not an IPv4 address.
int socket_listen(const std::string& ifaddr, int backlog, std::string* address, sockaddr_in* bound, std::string* error);

// Makes room in this process for `more` file descriptors beyond those open now (the connections of a
// world of ranks: one per peer, twice under the tcp backend), raising the soft RLIMIT_NOFILE as far as the
// hard limit allows where it is short, with room to spare for what the job opens later. Many systems start
// processes with a soft limit of 1024 and a far higher hard one, for select()'s sake; zero8 polls. Returns
// an empty string, or why there is no room (what `what` needs, the limits, the remedy), for the caller to
// raise as its peers learn of it.
std::string socket_reserve_descriptors(int64_t more, const std::string& what);
// Whether accept(), socket() or connect() failed for want of descriptors (or kernel memory for them).
bool socket_out_of_descriptors(int err);
// "RLIMIT_NOFILE soft S, hard H; N descriptors open": for an error about running out of them.
std::string socket_descriptor_text();

// Connects to `to` before the deadline: the connected socket (blocking, SOCK_CLOEXEC), or -1 with errno
// set (ETIMEDOUT once the deadline passed; ECONNREFUSED: nobody listens there yet).
int socket_connect(const sockaddr_in& to, double deadline);

// TCP_NODELAY and the partition detection of a connection between ranks: keepalive probes once the
// connection has been silent, ending it (recv() fails with ETIMEDOUT) when the peer's host has not
// answered for link_timeout_s seconds (ZERO8_COMM_LINK_TIMEOUT). user_timeout: also TCP_USER_TIMEOUT,
// which ends a connection whose sent data is not acknowledged for that long; only for connections that
// carry small frames, since the kernel also applies it to a peer that is alive but leaves its receive
// window full (seen on Linux 6.18: a 2 s TCP_USER_TIMEOUT ended a connection to a process that did not
// read for 3 s), which a busy rank does to a bulk data connection. Throws Error(comm) naming `who`.
void socket_set_link_options(int fd, int link_timeout_s, bool user_timeout, const std::string& who);

// Whether a connection failed with this errno because the peer's host stopped answering (keepalive or
// TCP_USER_TIMEOUT: ETIMEDOUT, or the last ICMP error the kernel got meanwhile), not a close or reset.
bool socket_link_error(int err);
// Whether the peer's kernel has been silent for longer than it ever is on a working link with these
// keepalive settings: a connection that ends after such a silence ended with the link (see liveness.cpp).
bool socket_silent_for_too_long(int fd, int link_timeout_s);

// Whether the peer's host has left this connection's outgoing data unanswered for link_timeout_s
// seconds: data sent and not acknowledged, or two zero-window probes in a row not answered, and no
// acknowledgement since. What keepalive does not see (it only probes a connection with nothing in
// flight), read from TCP_INFO instead of set as TCP_USER_TIMEOUT, which also ends a connection to a
// live peer that leaves its receive window shut (see socket_set_link_options): such a peer's kernel
// answers the window probes, which back off to minutes apart, so the time since its last answer says
// nothing; the count of unanswered probes does (tcpi_probes, reset by each answer). One probe may
// wait: a receiver rate-limits its answers to probes it cannot take (tcp_invalid_ratelimit, 0.5 s).
// The caller must also see the state last (see check_links in comm_tcp.cpp): a probe is unanswered
// for a round trip after it is sent.
bool socket_unanswered(int fd, int link_timeout_s);

// Waits until fd is ready for `events` or the deadline passes; false on timeout or a poll error.
bool socket_poll(int fd, short events, double deadline);
// Reads exactly n bytes before the deadline; false on timeout, EOF or an error.
bool socket_read_exact(int fd, void* buf, size_t n, double deadline);
// Writes [p, p + n) until done or the deadline: the count written (short on timeout), -1 if the
// connection failed. MSG_DONTWAIT and poll() bound the whole write, not each send() call; MSG_NOSIGNAL.
ssize_t socket_write_until(int fd, const char* p, size_t n, double deadline);

// A random 64-bit value for a job's token (rank 0's is the job's: a stray connection cannot join).
uint64_t socket_random_token();

}  // namespace zero8::comm::detail
