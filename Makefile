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

test: lint
	./scripts/setup-postgres.sh
	.venv/bin/python -m pytest -q -n 2 --dist loadfile

protos: venv
	./scripts/gen-protos.sh

bench: venv
	.venv/bin/python -m benchmarks
