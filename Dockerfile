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
COPY config/sluice.toml /etc/sluice/sluice.toml
USER 10001
ENV SLUICE_CONFIG=/etc/sluice/sluice.toml SLUICE_LOG_FORMAT=json
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["serve"]
