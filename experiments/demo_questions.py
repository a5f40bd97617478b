"""How the demo's questions were chosen: every candidate question that the demo's collection
answers, each prompt holding all its passages in an order of its own, answered by full prefill
and by blend.

Prints, per question, whether full's answer holds the expected words, whether blend's text equals
full's, both answers and both TTFTs, as JSON lines (with the passage order, which the demo's
collection.json keeps for the questions it asks).

    python experiments/demo_questions.py --model qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import random
from importlib import resources

from kvblend import LLM, SamplingParams

CANDIDATES = [
    ("How many arches does the Sorrel Bridge have?", "seven"),
    ("What is the name of the lighthouse of Caldmouth?", "Nettle Light"),
    ("Which steam engine is kept in the Caldmouth Museum?", "Heron"),
    ("How high is Mount Carrow?", "1,486"),
    ("What do the people of Skarra call their grey wool cloth?", "skarrel"),
    ("What fish lives only in Lake Orvane?", "char"),
    ("Who was the most famous editor of the Marrowick Gazette?", "Rosalind Teague"),
    ("What is the name of the footpath that crosses the Halden Hills?", "Ridgeway"),
    ("Who was the first rector of Halden University?", "Ada Pemberly"),
    ("What is the Lanternfly?", "inn"),
    ("Who founded the town of Marrowick?", "Elsbeth Varn"),
    ("In which month is the Lantern Fair held?", "October"),
    ("What is tesk pie made with?", "trout"),
    ("Where do the Marrowick Rovers play their home games?", "Kettle Field"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=11, help="seed of the passage orders")
    args = ap.parse_args()
    passages = json.loads(resources.files("kvblend.demo").joinpath("collection.json").read_text())["passages"]
    candidates = [(q, a) for q, a in CANDIDATES if a.lower() in " ".join(passages).lower()]  # answerable here
    llm = LLM(model=args.model)
    llm.store_documents(passages)
    llm.generate(candidates[0][0], SamplingParams(max_tokens=1), documents=passages, mode="full")  # warm-up
    rng = random.Random(args.seed)
    for question, expected in candidates:
        order = list(range(len(passages)))
        rng.shuffle(order)
        docs = [passages[i] for i in order]
        full, blend = [llm.generate(question, SamplingParams(max_tokens=args.max_tokens), documents=docs, mode=m)[0]
                       for m in ("full", "blend")]
        print(json.dumps({"question": question, "full_right": expected.lower() in full.text.lower(),
                          "same": full.text.strip() == blend.text.strip(), "full": full.text.strip(),
                          "blend": blend.text.strip(), "ttft_s": [full.metrics.ttft_s, blend.metrics.ttft_s],
                          "order": order}), flush=True)


if __name__ == "__main__":
    main()
