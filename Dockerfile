# idemgate: the idempotency-key gateway as a container.
#
#   docker build -t idemgate .
#   docker run -p 8080:8080 -p 9090:9090 -v idemgate-data:/data idemgate --upstream http://app:3000
#
# The build stage runs the same command as the README and CI: cargo build --release --locked.

FROM rust:1-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked

FROM debian:bookworm-slim
# The trusted roots a rediss:// store's certificate is checked against.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# A fixed, unprivileged user that owns the record store's directory.
RUN useradd --system --uid 10001 --user-group --home-dir /data --shell /usr/sbin/nologin idemgate \
    && mkdir -p /data \
    && chown idemgate:idemgate /data
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
COPY config/ /etc/idemgate/
USER idemgate
WORKDIR /data
# The embedded durable store (redb) keeps records here; mount a volume so they survive the
# container.
VOLUME /data
# Inside the container listen on every interface and keep records on the volume. Precedence
# is flags > IDEMGATE_* > config file > defaults, so these win over the same keys in a mounted
# config file: change them with a flag (--listen …) or with -e IDEMGATE_LISTEN=….
ENV IDEMGATE_LISTEN=0.0.0.0:8080 \
    IDEMGATE_ADMIN_LISTEN=0.0.0.0:9090 \
    IDEMGATE_STORE=redb:/data/idemgate.redb
# 8080: the proxy. 9090: /healthz, /readyz, /metrics and the token-protected record endpoints;
# do not publish it beyond the operators' network.
EXPOSE 8080 9090
STOPSIGNAL SIGTERM
ENTRYPOINT ["idemgate"]
