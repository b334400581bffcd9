"""`python -m engine.tokenizer_bench`: the command keeps its documented name; the code is engine/bench/tokenizer.py."""
from engine.bench.tokenizer import main

if __name__ == "__main__":
    main()
