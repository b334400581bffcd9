"""`python -m engine.random_model`: the command keeps its documented name; the code is engine/model/random_model.py."""
from engine.model.random_model import main

if __name__ == "__main__":
    main()
