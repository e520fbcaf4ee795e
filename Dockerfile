# One image for every kvemu role (router, worker, loadgen); compose picks the command.
FROM python:3.11-slim
# Marks kvemu's images, so a rebuild's superseded image can be pruned without touching anyone else's.
LABEL org.kvemu.image=kvemu
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY kvemu kvemu
COPY workers workers
COPY harness harness
COPY examples examples
# Pure Python: the slim image has no C compiler, so the compiled build (mypyc) is not attempted; the install
# says so in one line. Same reports, slower virtual runs (docs/architecture.md, "The compiled build").
ENV KVEMU_NO_COMPILE=1
RUN pip install --no-cache-dir --root-user-action=ignore . \
 || pip install --no-cache-dir .
ENTRYPOINT ["kvemu"]
