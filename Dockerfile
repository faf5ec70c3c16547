# kvroute: the router (`kvroute serve`), the benchmark (`kvroute bench`) and the rest of the CLI.
#
#   docker build -t kvroute:0.1.0 .
#   docker run --rm kvroute:0.1.0 bench --help
#
# Two stages: the wheel, whose native core (crates/, kvroute._native) needs a Rust toolchain,
# is built in the first; the slim runtime image installs only the wheel and its (manylinux)
# dependencies, so it carries no compiler.
# Debian 13's Rust (1.85) is new enough for the workspace (edition 2024).
FROM python:3.12-slim-trixie AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cargo rustc \
    && pip install "maturin>=1.7,<2"

WORKDIR /src
# pyproject.toml names README.md as the package's readme: the build needs both.
COPY pyproject.toml README.md Cargo.toml Cargo.lock /src/
COPY crates /src/crates
COPY src /src/src
RUN maturin build --release --locked --out /wheels

FROM python:3.12-slim-trixie

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY --from=build /wheels /tmp/wheels
RUN pip install /tmp/wheels/kvroute-*.whl && rm -rf /tmp/wheels

# The Helm chart's pods run as this user (bench results volumes get its group via fsGroup).
RUN useradd --create-home --uid 10001 --user-group kvroute
USER 10001:10001
WORKDIR /home/kvroute

# kvroute serve --port 8080 (the chart's router port).
EXPOSE 8080
ENTRYPOINT ["kvroute"]
CMD ["--help"]
