"""Question answering over synthetic documents: short company profiles, one of them asked about.

The context is a run of short generated documents, each a profile of one company: when and
in which city it was founded, its chief executive, how many people it employs and what it
is best known for. The question asks one attribute of one company. Three distractor
profiles are about companies whose names differ from the asked one by one word ("Halvard
Shipping" / "Halvard Textiles" / "Brenner Shipping"), with the asked attribute set to another
value (a head count one digit away); every other document is about some other company.
Right when the answer holds the asked value and none of the distractors' values of that
attribute (`Spec.wrong`). The reuse suite asks two other attributes of the same company and
the asked attribute of a distractor company.

Generated offline from the seed (names, people, places and products from fixed lists); no
two documents of one context are about the same company.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvedit.harness.eval.spec import Ask, Needle, Spec, distinct, near_number, number

NAMES = ["Halvard", "Brenner", "Castell", "Dunmore", "Everly", "Fairbank", "Galloway", "Hartwell",
         "Ingram", "Jessup", "Kessler", "Lindqvist", "Marlowe", "Norberg", "Oakridge", "Pemberton",
         "Quinlan", "Redfern", "Stanhope", "Thorne", "Underhill", "Vantage", "Whitcombe",
         "Yardley", "Ashgrove", "Blackmoor", "Coldwell", "Drayton", "Elmhurst", "Foxley",
         "Greystone", "Holloway", "Ivory", "Juniper", "Kingsley", "Larkspur", "Merriweather",
         "Northcott", "Osterman", "Prescott", "Ravensworth", "Silverton", "Tamworth", "Ulverston",
         "Westbrook", "Alder", "Bramwell", "Crestwood", "Dalton", "Eastwick", "Fenwick",
         "Glenmore", "Hadley", "Kimber", "Lockhart", "Mossley", "Pickering", "Rowntree",
         "Sheffield", "Wexford"]
KINDS = ["Shipping", "Textiles", "Robotics", "Foods", "Logistics", "Pharmaceuticals", "Mining",
         "Publishing", "Aviation", "Software", "Ceramics", "Furniture", "Optics", "Breweries",
         "Insurance", "Chemicals", "Engineering", "Media", "Energy", "Construction", "Motors",
         "Instruments", "Paper", "Glassworks"]
CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Rome", "Quito", "Dublin",
          "Nairobi", "Madrid", "Seoul", "Vienna", "Havana", "Lisbon", "Manila", "Prague",
          "Bogota", "Helsinki", "Santiago", "Warsaw", "Athens", "Jakarta", "Montreal",
          "Zurich", "Osaka", "Melbourne", "Casablanca", "Budapest", "Istanbul", "Toronto",
          "Stockholm"]
FIRST = ["Maria", "Daniel", "Aisha", "Lukas", "Mei", "Tomas", "Ingrid", "Rafael", "Sofia",
         "Kenji", "Amara", "Pavel", "Elena", "Omar", "Greta", "Victor", "Nadia", "Felix", "Leila",
         "Hugo", "Clara", "Mateo", "Yara", "Stefan"]
LAST = ["Ostrova", "Lindgren", "Okafor", "Brandt", "Moreau", "Tanaka", "Novak", "Castillo",
        "Haddad", "Fischer", "Kowalski", "Almeida", "Petrov", "Nakamura", "Larsen", "Romano",
        "Mensah", "Varga", "Duarte", "Keller", "Sato", "Ibrahim", "Jensen", "Costa"]
PRODUCTS = ["copper valves", "wool carpets", "glass lenses", "river barges", "canned fish",
            "paper maps", "steel bridges", "wind turbines", "leather boots", "cargo drones",
            "ceramic tiles", "printing presses", "solar panels", "hearing aids", "oak barrels",
            "silk scarves", "mountain tents", "pocket watches", "rubber tyres", "weather radios",
            "frozen berries", "marble statues", "fishing nets", "tower cranes"]


@dataclass(frozen=True)
class Company:
    name: str
    year: str
    city: str
    chief: str
    employees: str
    product: str

    def document(self) -> str:
        return (f" Company profile: {self.name}. {self.name} was founded in {self.year} in the "
                f"city of {self.city}. Its chief executive is {self.chief}. {self.name} employs "
                f"{self.employees} people and is best known for its {self.product}.")


# attribute -> (question, answer prime), each formatted with the company's name
QUESTIONS = {
    "year": ("In which year was {n} founded?", "{n} was founded in the year"),
    "city": ("In which city was {n} founded?", "{n} was founded in the city of"),
    "chief": ("Who is the chief executive of {n}?", "The chief executive of {n} is"),
    "employees": ("How many people does {n} employ?", "{n} employs"),
    "product": ("What is {n} best known for?", "{n} is best known for its"),
}


def company(rng: random.Random, name: str) -> Company:
    return Company(name, str(rng.randrange(1850, 2020)), rng.choice(CITIES),
                   f"{rng.choice(FIRST)} {rng.choice(LAST)}", number(rng, rng.choice((4, 5))),
                   rng.choice(PRODUCTS))


def _other_value(rng: random.Random, attr: str, value: str, taken: set[str]) -> str:
    """A value of `attr` that differs from `value` and from those `taken` (a head count one
    digit away)."""
    pool = {"city": CITIES, "product": PRODUCTS}.get(attr)
    while True:
        if attr == "employees":
            v = near_number(rng, value)
        elif attr == "year":
            v = str(rng.randrange(1850, 2020))
        elif attr == "chief":
            v = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        else:
            v = rng.choice(pool)
        if v != value and v not in taken:
            return v


class Documents:
    """The haystack: profiles of companies not yet in the context, one per call."""

    names = [f"{a} {b}" for a in NAMES for b in KINDS]

    def __init__(self, used: set[str]):
        self.used = set(used)

    def __call__(self, rng: random.Random) -> str:
        for _ in range(10_000):
            name = rng.choice(self.names)
            if name not in self.used:
                self.used.add(name)
                return company(rng, name).document()
        raise ValueError(f"docqa: {len(self.used)} companies fill the name space; ask for a "
                         "shorter context")


def question(c: Company, attr: str, wrong=()) -> Ask:
    q, prime = QUESTIONS[attr]
    return Ask(q.format(n=c.name), prime.format(n=c.name), (getattr(c, attr),), tuple(wrong))


def docqa(rng: random.Random, depth: float, length: int) -> Spec:
    first, kind = rng.choice(NAMES), rng.choice(KINDS)
    alt_first = distinct(rng, 1, lambda: rng.choice(NAMES), avoid=(first,))
    alt_kind = distinct(rng, 2, lambda: rng.choice(KINDS), avoid=(kind,))
    names = [f"{first} {kind}", f"{first} {alt_kind[0]}", f"{alt_first[0]} {kind}",
             f"{first} {alt_kind[1]}"]
    attr = rng.choice(sorted(QUESTIONS))
    asked = company(rng, names[0])
    taken = {getattr(asked, attr)}
    similar = []
    for n in names[1:]:  # same kind of company, the asked attribute always different
        v = _other_value(rng, attr, getattr(asked, attr), taken)
        taken.add(v)
        similar.append(replace(company(rng, n), **{attr: v}))
    wrong = tuple(getattr(c, attr) for c in similar)
    needles = (Needle(asked.document(), depth),) + tuple(
        Needle(c.document(), rng.uniform(0.02, 0.98)) for c in similar)
    main = question(asked, attr, wrong)
    others = [a for a in sorted(QUESTIONS) if a != attr]
    more = tuple(question(asked, a, {getattr(c, a) for c in similar} - {getattr(asked, a)})
                 for a in rng.sample(others, 2))
    more += (question(similar[0], attr, taken - {getattr(similar[0], attr)}),)
    return Spec(needles, main.question, main.prime, main.answers, 12, more, wrong=wrong,
                haystack=Documents(set(names)))
