# Sluice: multi-stage build. The final image holds the binary, its default config and CA roots,
# and runs as a non-root user. Build: docker build -t sluice .
FROM rust:1-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
RUN cargo build --release --locked

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home sluice
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
# The container config listens on every interface; mount your own over it (see deploy/).
COPY deploy/docker/sluice.toml /etc/sluice/sluice.toml
USER 10001
ENV SLUICE_CONFIG=/etc/sluice/sluice.toml SLUICE_LOG_FORMAT=json
EXPOSE 8080 9090
# Liveness of the process (not readiness: an image with no healthy backend is still alive),
# on the admin port, which stays plain HTTP when the API port serves TLS.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/sluice", "probe", "--url", "http://127.0.0.1:9090/healthz", "--timeout", "2s"]
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["serve"]
