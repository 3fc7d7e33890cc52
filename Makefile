# The two commands of the README (`test` installs the PostgreSQL server its catalog tests start and runs the
# linters beside the suite), plus regenerating the protos.
.PHONY: run test lint protos venv bench

PORT ?= 50051

venv:
	./scripts/setup-venv.sh

run: venv
	.venv/bin/shardserve up --ranks 2 --port $(PORT) --demo

lint: venv
	./scripts/lint.sh

# scripts/test.sh: sets up .venv and PostgreSQL, then runs the linters beside the suite; `make test ARGS=...`
# passes arguments to pytest.
test:
	./scripts/test.sh $(ARGS)

protos: venv
	./scripts/gen-protos.sh

bench: venv
	.venv/bin/python -m benchmarks
