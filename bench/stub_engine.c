/* A stub inference engine for proxy benchmarks (bench/peers.py): one thread, epoll, HTTP/1.1
 * keep-alive on 127.0.0.1, a canned answer per route and no work, so that what a benchmark
 * measures behind it is the proxy in front.
 *
 *   GET  /health, /readiness, /liveness    200, empty body
 *   GET  /v1/models, /get_model_info, /get_server_info   small JSON
 *   POST /inference/v1/generate            a vLLM 0.24 generate answer: 16 token ids (epd-router's PD hop)
 *   POST anything else                     an OpenAI chat.completion with 16 tokens (what the Rust
 *                                          gateways forward /v1/chat/completions to)
 *
 * Build: cc -O2 -o stub_engine stub_engine.c     Run: stub_engine PORT
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_EVENTS 256
#define BUF_SIZE (1 << 20) /* a request head plus body must fit: text requests are a few KiB */

static const char GENERATE_BODY[] =
    "{\"request_id\":\"0123456789abcdef\",\"choices\":[{\"index\":0,\"logprobs\":null,"
    "\"finish_reason\":\"length\",\"token_ids\":[40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55]}],"
    "\"prompt_logprobs\":null,\"kv_transfer_params\":null}";

static const char CHAT_BODY[] =
    "{\"id\":\"chatcmpl-stub\",\"object\":\"chat.completion\",\"created\":1700000000,\"model\":\"bench\","
    "\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":"
    "\"one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen\"},"
    "\"finish_reason\":\"length\"}],"
    "\"usage\":{\"prompt_tokens\":24,\"completion_tokens\":16,\"total_tokens\":40}}";

static const char MODELS_BODY[] =
    "{\"object\":\"list\",\"data\":[{\"id\":\"bench\",\"object\":\"model\",\"owned_by\":\"stub\"}]}";

static const char INFO_BODY[] = "{\"model_path\":\"bench\",\"is_generation\":true}";

struct conn {
    int fd;
    size_t len;
    char buf[BUF_SIZE];
};

static size_t header_value(const char *head, size_t head_len, const char *name) {
    size_t name_len = strlen(name);
    for (size_t i = 0; i + name_len < head_len; i++) {
        if ((i == 0 || head[i - 1] == '\n') && strncasecmp(head + i, name, name_len) == 0)
            return strtoul(head + i + name_len, NULL, 10);
    }
    return 0;
}

static int write_all(int fd, const char *data, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) { /* tiny answers: wait for room rather than buffer */
                fd_set w;
                FD_ZERO(&w);
                FD_SET(fd, &w);
                select(fd + 1, NULL, &w, NULL, NULL);
                continue;
            }
            return -1;
        }
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

static int respond(int fd, const char *head) {
    const char *body = "";
    const char *type = "text/plain";
    if (strncmp(head, "GET ", 4) == 0) {
        if (strncmp(head + 4, "/v1/models", 10) == 0) {
            body = MODELS_BODY;
            type = "application/json";
        } else if (strncmp(head + 4, "/get_", 5) == 0) {
            body = INFO_BODY;
            type = "application/json";
        }
    } else if (strncmp(head, "POST /inference/v1/generate", 27) == 0) {
        body = GENERATE_BODY;
        type = "application/json";
    } else {
        body = CHAT_BODY;
        type = "application/json";
    }
    char out[4096];
    size_t body_len = strlen(body);
    int n = snprintf(out, sizeof out, "HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %zu\r\n\r\n%s", type,
                     body_len, body);
    return write_all(fd, out, (size_t)n);
}

/* Answer every complete request in the buffer; -1 closes the connection. */
static int serve(struct conn *c) {
    for (;;) {
        char *end = memmem(c->buf, c->len, "\r\n\r\n", 4);
        if (end == NULL) return c->len < BUF_SIZE ? 0 : -1;
        size_t head_len = (size_t)(end - c->buf) + 4;
        size_t total = head_len + header_value(c->buf, head_len, "content-length:");
        if (total > BUF_SIZE) return -1;
        if (c->len < total) return 0;
        if (respond(c->fd, c->buf) < 0) return -1;
        memmove(c->buf, c->buf + total, c->len - total);
        c->len -= total;
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s PORT\n", argv[0]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[1])),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 1024) < 0) {
        perror("bind/listen");
        return 1;
    }
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    struct epoll_event events[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(ep, events, MAX_EVENTS, -1);
        for (int i = 0; i < n; i++) {
            struct conn *c = events[i].data.ptr;
            if (c == NULL) { /* the listener */
                int fd;
                while ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    struct conn *nc = malloc(sizeof *nc);
                    nc->fd = fd;
                    nc->len = 0;
                    struct epoll_event cev = {.events = EPOLLIN, .data.ptr = nc};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &cev);
                }
                continue;
            }
            ssize_t got = read(c->fd, c->buf + c->len, BUF_SIZE - c->len);
            if (got > 0) {
                c->len += (size_t)got;
                if (serve(c) == 0) continue;
            } else if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
                continue;
            }
            close(c->fd); /* closing removes it from the epoll set */
            free(c);
        }
    }
}
