# The two commands of the README (`test` runs the linters first and installs the PostgreSQL server its catalog
# tests start), plus regenerating the protos.
.PHONY: run test lint protos venv bench

PORT ?= 50051

venv:
	./scripts/setup-venv.sh

run: venv
	.venv/bin/shardserve up --ranks 2 --port $(PORT) --demo

lint: venv
	./scripts/lint.sh

# The project's modules are compiled once first: every process the suite starts (ranks, CLIs, benchmarks)
# then reads them, also where PYTHONDONTWRITEBYTECODE is set, instead of compiling them again each.
test: lint
	./scripts/setup-postgres.sh
	.venv/bin/python -m compileall -q shardserve client server protos shardcore benchmarks
	.venv/bin/python -m pytest -q -n 2 --dist loadfile

protos: venv
	./scripts/gen-protos.sh

bench: venv
	.venv/bin/python -m benchmarks
