# One image for every kvemu role (router, worker, loadgen); compose picks the command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvemu kvemu
COPY workers workers
COPY harness harness
COPY examples examples
RUN pip install --no-cache-dir --root-user-action=ignore . \
 || pip install --no-cache-dir .
ENTRYPOINT ["kvemu"]
