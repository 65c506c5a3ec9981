"""`forage eval`: Search-R1's evaluation (EM, F1, sub-EM per dataset) as one command.

Small modules with one job each: `stats` (pure metrics and statistics), `data` (question
files in Search-R1's, FlashRAG's and Forage's layouts), `prompts` (what each mode asks),
`retrieval` (live, in-process, recorded and replayed search results), `results` (the output
directory: config check, per-question lines, resume), `runner` (plays questions through the
agent loop), `errors` (why a wrong agent answer is wrong), `evidence` (the evidence-reliance
probe), `report` (eval.json and eval.md) and `cli` (the thin command). The services never
import this package; it imports theirs, as services/launch does.
"""
