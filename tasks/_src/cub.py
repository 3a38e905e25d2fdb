"""CUB-200-2011 (Wah et al. 2011) in Meta-Dataset's split: 140/30/30 bird species, read from the extracted archive.

``CUB_200_2011.tgz`` extracts to ``CUB_200_2011/`` holding ``images/<class>/<file>.jpg``, ``images.txt``
(``<image id> <class>/<file>.jpg``, the list of the images read) and ``bounding_boxes.txt`` (``<image id>
<x> <y> <width> <height>``). The root is that folder or the one holding it. The 43 images that are also
in ILSVRC-2012 (Meta-Dataset's list) are left out unless asked for, so that a network pretrained on
ImageNet has not seen a test image.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import numpy as np

from . import image_files as files
from .fine_grained import Crop, FineGrainedImages, box_crop, decode_all, lines, numbers
from .image_data import IMAGE_DATASETS
from .image_files import Decoded
from .image_layouts import DATASETS, DataSpec, Layout

FOLDER = "CUB_200_2011"

# Meta-Dataset's class split (Triantafillou et al. 2020), as learn2learn ships it (cu_birds200.py), in its order.
CLASS_SPLITS: dict[str, tuple[str, ...]] = {
    "train": (
        "190.Red_cockaded_Woodpecker",
        "144.Common_Tern",
        "014.Indigo_Bunting",
        "012.Yellow_headed_Blackbird",
        "059.California_Gull",
        "031.Black_billed_Cuckoo",
        "071.Long_tailed_Jaeger",
        "018.Spotted_Catbird",
        "177.Prothonotary_Warbler",
        "040.Olive_sided_Flycatcher",
        "063.Ivory_Gull",
        "073.Blue_Jay",
        "166.Golden_winged_Warbler",
        "160.Black_throated_Blue_Warbler",
        "016.Painted_Bunting",
        "149.Brown_Thrasher",
        "126.Nelson_Sharp_tailed_Sparrow",
        "090.Red_breasted_Merganser",
        "074.Florida_Jay",
        "058.Pigeon_Guillemot",
        "105.Whip_poor_Will",
        "043.Yellow_bellied_Flycatcher",
        "158.Bay_breasted_Warbler",
        "192.Downy_Woodpecker",
        "129.Song_Sparrow",
        "161.Blue_winged_Warbler",
        "132.White_crowned_Sparrow",
        "146.Forsters_Tern",
        "011.Rusty_Blackbird",
        "070.Green_Violetear",
        "197.Marsh_Wren",
        "041.Scissor_tailed_Flycatcher",
        "100.Brown_Pelican",
        "120.Fox_Sparrow",
        "032.Mangrove_Cuckoo",
        "119.Field_Sparrow",
        "183.Northern_Waterthrush",
        "007.Parakeet_Auklet",
        "053.Western_Grebe",
        "001.Black_footed_Albatross",
        "102.Western_Wood_Pewee",
        "164.Cerulean_Warbler",
        "036.Northern_Flicker",
        "131.Vesper_Sparrow",
        "098.Scott_Oriole",
        "188.Pileated_Woodpecker",
        "139.Scarlet_Tanager",
        "107.Common_Raven",
        "108.White_necked_Raven",
        "184.Louisiana_Waterthrush",
        "099.Ovenbird",
        "171.Myrtle_Warbler",
        "075.Green_Jay",
        "097.Orchard_Oriole",
        "152.Blue_headed_Vireo",
        "173.Orange_crowned_Warbler",
        "095.Baltimore_Oriole",
        "042.Vermilion_Flycatcher",
        "054.Blue_Grosbeak",
        "079.Belted_Kingfisher",
        "006.Least_Auklet",
        "142.Black_Tern",
        "078.Gray_Kingbird",
        "047.American_Goldfinch",
        "050.Eared_Grebe",
        "037.Acadian_Flycatcher",
        "196.House_Wren",
        "083.White_breasted_Kingfisher",
        "062.Herring_Gull",
        "138.Tree_Swallow",
        "060.Glaucous_winged_Gull",
        "182.Yellow_Warbler",
        "027.Shiny_Cowbird",
        "174.Palm_Warbler",
        "157.Yellow_throated_Vireo",
        "117.Clay_colored_Sparrow",
        "175.Pine_Warbler",
        "024.Red_faced_Cormorant",
        "106.Horned_Puffin",
        "151.Black_capped_Vireo",
        "005.Crested_Auklet",
        "185.Bohemian_Waxwing",
        "049.Boat_tailed_Grackle",
        "010.Red_winged_Blackbird",
        "153.Philadelphia_Vireo",
        "017.Cardinal",
        "023.Brandt_Cormorant",
        "115.Brewer_Sparrow",
        "104.American_Pipit",
        "109.American_Redstart",
        "167.Hooded_Warbler",
        "123.Henslow_Sparrow",
        "019.Gray_Catbird",
        "067.Anna_Hummingbird",
        "081.Pied_Kingfisher",
        "077.Tropical_Kingbird",
        "088.Western_Meadowlark",
        "048.European_Goldfinch",
        "141.Artic_Tern",
        "013.Bobolink",
        "029.American_Crow",
        "025.Pelagic_Cormorant",
        "135.Bank_Swallow",
        "056.Pine_Grosbeak",
        "179.Tennessee_Warbler",
        "087.Mallard",
        "195.Carolina_Wren",
        "038.Great_Crested_Flycatcher",
        "092.Nighthawk",
        "187.American_Three_toed_Woodpecker",
        "003.Sooty_Albatross",
        "004.Groove_billed_Ani",
        "156.White_eyed_Vireo",
        "180.Wilson_Warbler",
        "034.Gray_crowned_Rosy_Finch",
        "093.Clark_Nutcracker",
        "110.Geococcyx",
        "154.Red_eyed_Vireo",
        "143.Caspian_Tern",
        "089.Hooded_Merganser",
        "186.Cedar_Waxwing",
        "069.Rufous_Hummingbird",
        "125.Lincoln_Sparrow",
        "026.Bronzed_Cowbird",
        "111.Loggerhead_Shrike",
        "022.Chuck_will_Widow",
        "165.Chestnut_sided_Warbler",
        "021.Eastern_Towhee",
        "191.Red_headed_Woodpecker",
        "086.Pacific_Loon",
        "124.Le_Conte_Sparrow",
        "002.Laysan_Albatross",
        "033.Yellow_billed_Cuckoo",
        "189.Red_bellied_Woodpecker",
        "116.Chipping_Sparrow",
        "130.Tree_Sparrow",
        "114.Black_throated_Sparrow",
        "065.Slaty_backed_Gull",
        "091.Mockingbird",
        "181.Worm_eating_Warbler",
    ),
    "val": (
        "044.Frigatebird",
        "051.Horned_Grebe",
        "052.Pied_billed_Grebe",
        "055.Evening_Grosbeak",
        "057.Rose_breasted_Grosbeak",
        "061.Heermann_Gull",
        "064.Ring_billed_Gull",
        "066.Western_Gull",
        "068.Ruby_throated_Hummingbird",
        "072.Pomarine_Jaeger",
        "076.Dark_eyed_Junco",
        "080.Green_Kingfisher",
        "084.Red_legged_Kittiwake",
        "096.Hooded_Oriole",
        "113.Baird_Sparrow",
        "121.Grasshopper_Sparrow",
        "127.Savannah_Sparrow",
        "136.Barn_Swallow",
        "140.Summer_Tanager",
        "145.Elegant_Tern",
        "150.Sage_Thrasher",
        "155.Warbling_Vireo",
        "159.Black_and_white_Warbler",
        "162.Canada_Warbler",
        "172.Nashville_Warbler",
        "176.Prairie_Warbler",
        "178.Swainson_Warbler",
        "198.Rock_Wren",
        "199.Winter_Wren",
        "200.Common_Yellowthroat",
    ),
    "test": (
        "008.Rhinoceros_Auklet",
        "009.Brewer_Blackbird",
        "015.Lazuli_Bunting",
        "020.Yellow_breasted_Chat",
        "028.Brown_Creeper",
        "030.Fish_Crow",
        "035.Purple_Finch",
        "039.Least_Flycatcher",
        "045.Northern_Fulmar",
        "046.Gadwall",
        "082.Ringed_Kingfisher",
        "085.Horned_Lark",
        "094.White_breasted_Nuthatch",
        "101.White_Pelican",
        "103.Sayornis",
        "112.Great_Grey_Shrike",
        "118.House_Sparrow",
        "122.Harris_Sparrow",
        "128.Seaside_Sparrow",
        "133.White_throated_Sparrow",
        "134.Cape_Glossy_Starling",
        "137.Cliff_Swallow",
        "147.Least_Tern",
        "148.Green_tailed_Towhee",
        "163.Cape_May_Warbler",
        "168.Kentucky_Warbler",
        "169.Magnolia_Warbler",
        "170.Mourning_Warbler",
        "193.Bewick_Wren",
        "194.Cactus_Wren",
    ),
}
# The images that are also in ILSVRC-2012, by the split of their class (Meta-Dataset's list, as learn2learn ships it).
IMAGENET_DUPLICATES: dict[str, tuple[str, ...]] = {
    "train": (
        "American_Goldfinch_0062_31921.jpg",
        "Indigo_Bunting_0063_11820.jpg",
        "Blue_Jay_0053_62744.jpg",
        "American_Goldfinch_0131_32911.jpg",
        "Indigo_Bunting_0051_12837.jpg",
        "American_Goldfinch_0012_32338.jpg",
        "Laysan_Albatross_0033_658.jpg",
        "Black_Footed_Albatross_0024_796089.jpg",
        "Indigo_Bunting_0072_14197.jpg",
        "Green_Violetear_0002_795699.jpg",
        "Black_Footed_Albatross_0033_796086.jpg",
        "Black_Footed_Albatross_0086_796062.jpg",
        "Anna_Hummingbird_0034_56614.jpg",
        "American_Goldfinch_0064_32142.jpg",
        "Red_Breasted_Merganser_0068_79203.jpg",
        "Blue_Jay_0033_62024.jpg",
        "Indigo_Bunting_0071_11639.jpg",
        "Red_Breasted_Merganser_0001_79199.jpg",
        "Indigo_Bunting_0060_14495.jpg",
        "Laysan_Albatross_0053_543.jpg",
        "American_Goldfinch_0018_32324.jpg",
        "Red_Breasted_Merganser_0034_79292.jpg",
        "Mallard_0067_77623.jpg",
        "Red_Breasted_Merganser_0083_79562.jpg",
        "Laysan_Albatross_0049_918.jpg",
        "Black_Footed_Albatross_0002_55.jpg",
        "Red_Breasted_Merganser_0012_79425.jpg",
        "Indigo_Bunting_0031_13300.jpg",
        "Blue_Jay_0049_63082.jpg",
        "Indigo_Bunting_0010_13000.jpg",
        "Red_Breasted_Merganser_0004_79232.jpg",
        "Red_Breasted_Merganser_0045_79358.jpg",
        "American_Goldfinch_0116_31943.jpg",
        "Blue_Jay_0068_61543.jpg",
        "Indigo_Bunting_0073_13933.jpg",
    ),
    "val": (
        "Dark_Eyed_Junco_0057_68650.jpg",
        "Dark_Eyed_Junco_0102_67402.jpg",
        "Ruby_Throated_Hummingbird_0090_57411.jpg",
        "Dark_Eyed_Junco_0031_66785.jpg",
        "Dark_Eyed_Junco_0037_66321.jpg",
        "Dark_Eyed_Junco_0111_66488.jpg",
        "Ruby_Throated_Hummingbird_0040_57982.jpg",
        "Dark_Eyed_Junco_0104_67820.jpg",
    ),
    "test": (),
}
IMAGENET_DUPLICATES_ALL = frozenset(name for names in IMAGENET_DUPLICATES.values() for name in names)


def _base(root: Path) -> Path:
    """The folder holding ``images/``: ``root``, or ``root/CUB_200_2011`` when ``root`` holds the extracted folder."""
    inner = root / FOLDER
    if not (root / "images").exists() and not (root / "images.txt").exists() and inner.is_dir():
        return inner
    return root


def _files(boxes: bool) -> Any:
    def files_of(root: Path, split: str) -> list[Path]:
        base = _base(root)
        return [base / "images", base / "images.txt", *([base / "bounding_boxes.txt"] if boxes else [])]

    return files_of


def _names(root: Path, split: str, help: str) -> list[str]:
    """The split's classes, each with its folder under ``images/`` (a missing one is one line naming it)."""
    images = _base(root) / "images"
    classes = list(CLASS_SPLITS[split])
    missing = [c for c in classes if not (images / c).is_dir()]
    if missing:
        raise ValueError(
            f"{images} holds no folder {missing[0]} ({len(missing)} of the {len(classes)} classes of the {split} "
            f"split missing): Meta-Dataset's split of CUB-200-2011 needs all 200 class folders, as "
            f"CUB_200_2011.tgz extracts them; {help}"
        )
    return classes


def _listed(root: Path, split: str, duplicates: bool, help: str) -> list[tuple[str, Path, int]]:
    """``(image id, file, class index)`` of the split's images as ``images.txt`` lists them, each one checked to be
    in its class folder (one listing of each folder, not a look-up per image)."""
    base = _base(root)
    index = base / "images.txt"
    classes = {c: i for i, c in enumerate(_names(root, split, help))}
    try:
        stamp = os.stat(index)
    except OSError as exc:
        raise ValueError(f"{files.unreadable(index, exc)}; {help}") from None
    out, where = _parsed(index, (stamp.st_mtime_ns, stamp.st_size, stamp.st_ino), split, duplicates, help)
    present: dict[str, set[str]] = {}
    for folder in classes:
        with os.scandir(base / "images" / folder) as entries:
            present[folder] = {e.name for e in entries}
    missing = [f"{folder}/{file}" for folder, file in where if file not in present[folder]]
    if missing:
        raise ValueError(
            f"{index} lists images of the {split} split missing from {base / 'images'} ({len(missing)} in all; first: "
            f"{missing[0]}); {help}"
        )
    empty = sorted(set(classes.values()) - {c for _, _, c in out})
    if empty:
        raise ValueError(f"{index} lists no image of the class {CLASS_SPLITS[split][empty[0]]}; {help}")
    return out


@functools.lru_cache(maxsize=8)
def _parsed(
    index: Path, stamp: tuple[int, int, int], split: str, duplicates: bool, help: str
) -> tuple[list[tuple[str, Path, int]], list[tuple[str, str]]]:
    """:func:`_listed`'s images of ``split`` in ``index`` (``images.txt``), and each one's ``(class folder, file)``,
    once per version of the file (``stamp``: its modification time, size and inode): a load reads it twice for
    every split, and a warm load of 60,000 images would otherwise spend seconds splitting and joining its lines."""
    classes = {c: i for i, c in enumerate(CLASS_SPLITS[split])}
    images = index.parent / "images"
    out, where = [], []
    for image_id, name in _rows(index, stamp, help):
        folder, _, file = name.partition("/")
        if folder in classes and (duplicates or file not in IMAGENET_DUPLICATES_ALL):
            out.append((image_id, images / name, classes[folder]))
            where.append((folder, file))
    return out, where


@functools.lru_cache(maxsize=2)
def _rows(index: Path, stamp: tuple[int, int, int], help: str) -> list[tuple[str, str]]:
    """``(image id, class folder/file)`` of every line of ``index``, once per version of the file; an id or an image
    listed twice is one line naming both lines."""
    ids: dict[str, int] = {}
    names: dict[str, int] = {}
    rows = []
    for number, (image_id, name) in lines(index, 2, help, "'<image id> <class folder>/<file>.jpg'"):
        for seen, key, what in ((ids, image_id, "image id"), (names, name, "image")):
            if key in seen:
                raise ValueError(
                    f"{index} lists the {what} {key} twice, on lines {seen[key]} and {number}; an image is listed "
                    f"once; {help}"
                )
            seen[key] = number
        rows.append((image_id, name))
    return rows


def _boxes(path: Path, help: str) -> dict[str, tuple[float, float, float, float]]:
    what = "'<image id> <x> <y> <width> <height>'"
    boxes = {}
    for number, fields in lines(path, 5, help, what):
        x, y, w, h = numbers(path, number, fields[1:], help, what)
        boxes[fields[0]] = (x, y, x + w, y + h)
    return boxes


def _reader(duplicates: bool, boxes: bool) -> Any:
    def read(root: Path, split: str, side: int, help: str) -> Decoded:
        listed = _listed(root, split, duplicates, help)
        files.one_file_each([p for _, p, _ in listed], help)
        crops: list[Crop] = [None] * len(listed)
        if boxes:
            path = _base(root) / "bounding_boxes.txt"
            table = _boxes(path, help)
            absent = [image_id for image_id, _, _ in listed if image_id not in table]
            if absent:
                raise ValueError(f"{path} holds no box of image id {absent[0]} (listed in images.txt); {help}")
            crops = [box_crop(table[i], f"{path} for {p}", help) for i, p, _ in listed]
        images = decode_all([(p, crop) for (_, p, _), crop in zip(listed, crops)], side, help)
        labels = np.array([c for _, _, c in listed], dtype=np.int64)
        return Decoded(images, labels, list(CLASS_SPLITS[split]))

    return read


def _inputs(duplicates: bool, boxes: bool) -> Any:
    def inputs(root: Path, split: str) -> list[Path]:
        base = _base(root)
        extra = [base / "bounding_boxes.txt"] if boxes else []
        try:
            listed = _listed(root, split, duplicates, CUB.help())
        except ValueError:  # the reader reports it, with the data set's help
            return [base / "images.txt", *extra]
        return [base / "images.txt", *extra, *(p for _, p, _ in listed)]

    return inputs


def layout(duplicates: bool = False, boxes: bool = False) -> Layout:
    """The extracted archive, read with the options (their names are in the layout's, and so in the cache key)."""
    name = "extracted" + ("+imagenet-duplicates" if duplicates else "") + ("+bounding-boxes" if boxes else "")
    return Layout(
        name,
        "Caltech's CUB_200_2011.tgz",
        _files(boxes),
        _reader(duplicates, boxes),
        inputs=_inputs(duplicates, boxes),
        names=_names,
    )


CUB = DataSpec(
    "CUB-200-2011",
    "cub",
    84,
    (140, 30, 30),
    "CUB_DIR",
    "extract CUB_200_2011.tgz from https://www.vision.caltech.edu/datasets/cub_200_2011/ and pass the CUB_200_2011 "
    "folder (holding images/ and images.txt) or the folder holding it",
    (layout(),),
)


class CUB200(FineGrainedImages):
    """CUB-200-2011 (Wah et al. 2011) in Meta-Dataset's split: 140/30/30 bird species, 84x84 RGB.

    Args:
        root, split, class_counts, cache_dir, cache: as :class:`tasks.FewShotImages`; ``root`` is the
            extracted ``CUB_200_2011`` folder (holding ``images/`` and ``images.txt``) or the folder holding it.
        include_imagenet_duplicates: keep the 43 images that are also in ILSVRC-2012 (left out by default,
            as Meta-Dataset does; 35 of the train split, 8 of the validation split).
        bounding_box_crop: crop each image to its box in ``bounding_boxes.txt`` before it is resized.
    """

    spec = CUB
    _archive = ("CUB_200_2011.tgz", "tar xzf CUB_200_2011.tgz")

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        split: str = "train",
        *,
        include_imagenet_duplicates: bool = False,
        bounding_box_crop: bool = False,
        **kwargs: Any,
    ) -> None:
        spec = dataclasses.replace(CUB, layouts=(layout(include_imagenet_duplicates, bounding_box_crop),))
        self._load(root, split, spec, kwargs)


# Registered after the sets of image_layouts and image_data (--dataset cub).
DATASETS[CUB.key] = CUB
IMAGE_DATASETS[CUB.key] = CUB200
