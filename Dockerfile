# kvroute: the router (`kvroute serve`), the benchmark (`kvroute bench`) and the rest of the CLI.
#
#   docker build -t kvroute:0.1.0 .
#   docker run --rm kvroute:0.1.0 bench --help
#
# Every dependency ships manylinux wheels, so the slim image needs no compiler.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# pyproject.toml names README.md as the package's readme: the build needs both.
COPY pyproject.toml README.md /tmp/kvroute/
COPY src /tmp/kvroute/src
RUN pip install /tmp/kvroute && rm -rf /tmp/kvroute

# The Helm chart's pods run as this user (bench results volumes get its group via fsGroup).
RUN useradd --create-home --uid 10001 --user-group kvroute
USER 10001:10001
WORKDIR /home/kvroute

# kvroute serve --port 8080 (the chart's router port).
EXPOSE 8080
ENTRYPOINT ["kvroute"]
CMD ["--help"]
